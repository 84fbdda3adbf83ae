"""The cache format: the only contract between `dflash.extract` and `dflash.train` (spec: FORMAT.md)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dflash")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

# Exports load on first use (PEP 562) so that light paths (errors, CLI helpers, the dry run) never pay for
# importing torch through the codecs.
_EXPORTS = {
    "Cache": "cache",
    "CacheEntry": "cache",
    "Codec": "codecs",
    "CorruptFrame": "errors",
    "DiskFull": "errors",
    "EncodedSample": "writer",
    "Fp8Block": "codecs",
    "Manifest": "manifest",
    "ManifestMismatch": "errors",
    "Sample": "reader",
    "ShardError": "errors",
    "ShardInfo": "manifest",
    "ShardMeta": "writer",
    "ShardReader": "reader",
    "ShardWriter": "writer",
    "VerifyReport": "verify",
    "codec_from_dict": "codecs",
    "dequantize_fp8": "codecs",
    "diff_manifests": "manifest",
    "encode_sample": "writer",
    "get_codec": "codecs",
    "load_manifest": "manifest",
    "quantize_fp8": "codecs",
    "save_manifest": "manifest",
    "shard_name": "paths",
    "TargetConfig": "target_config",
    "TargetParts": "target_parts",
    "read_target_config": "target_config",
    "read_target_parts": "target_parts",
    "resolve_layer_ids": "layers",
    "target_fingerprint": "manifest",
    "target_info": "manifest",
    "verify_cache": "verify",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "Cache",
    "CacheEntry",
    "Codec",
    "CorruptFrame",
    "DiskFull",
    "EncodedSample",
    "Fp8Block",
    "Manifest",
    "ManifestMismatch",
    "Sample",
    "ShardError",
    "ShardInfo",
    "ShardMeta",
    "ShardReader",
    "ShardWriter",
    "TargetConfig",
    "TargetParts",
    "VerifyReport",
    "__version__",
    "codec_from_dict",
    "dequantize_fp8",
    "diff_manifests",
    "encode_sample",
    "get_codec",
    "load_manifest",
    "quantize_fp8",
    "read_target_config",
    "read_target_parts",
    "resolve_layer_ids",
    "save_manifest",
    "shard_name",
    "target_fingerprint",
    "target_info",
    "verify_cache",
]
