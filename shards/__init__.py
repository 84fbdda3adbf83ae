"""The cache format: the only contract between `dflash.extract` and `dflash.train` (spec: FORMAT.md)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dflash")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

from .codecs import Codec, Fp8Block, codec_from_dict, get_codec, quantize_fp8
from .errors import CorruptFrame, DiskFull, ManifestMismatch, ShardError
from .manifest import (
    Manifest,
    ShardInfo,
    diff_manifests,
    load_manifest,
    save_manifest,
    target_fingerprint,
    target_info,
)
from .reader import Cache, CacheEntry, Sample, ShardReader
from .verify import VerifyReport, verify_cache
from .writer import EncodedSample, ShardMeta, ShardWriter, encode_sample, shard_name

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
    "VerifyReport",
    "__version__",
    "codec_from_dict",
    "diff_manifests",
    "encode_sample",
    "get_codec",
    "load_manifest",
    "quantize_fp8",
    "save_manifest",
    "shard_name",
    "target_fingerprint",
    "target_info",
    "verify_cache",
]
