"""`CACHE/manifest.json`: provenance, options and plan of a cache, written atomically (spec: FORMAT.md).

`complete` is false while extracting; the final write adds the per-shard entries and sets it true, so
a complete cache is opened without listing the directory or reading any shard footer.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from . import __version__
from .atomic import atomic_write_bytes
from .errors import ManifestMismatch, ShardError
from .paths import MANIFEST_NAME
from .safe_io import load_json, read_regular
from .target_config import decoder_config
from .target_files import parse_target_files

FORMAT_NAME = "dflash-cache"
FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 256 << 20  # a manifest lists shards and skipped rows; anything bigger is not ours

# Fields whose difference makes a cache unusable for a resume or a training run (see diff_manifests).
PROVENANCE_FIELDS = (
    "format",
    "version",
    "target",
    "layers",
    "dtype",
    "hidden_size",
    "codec",
    "dataset",
    "options",
    "plan",
)


@dataclass(kw_only=True, slots=True)
class ShardInfo:
    """One committed shard: file name (relative to CACHE/shards), rows, tokens, bytes, index checksum."""

    name: str
    rows: int
    tokens: int
    bytes: int
    index_checksum: str
    supervised: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "manifest") -> ShardInfo:
        if not isinstance(d, Mapping):
            raise ShardError(f"{source}: shard entry must be an object, got {d!r:.80}")
        known = {f.name for f in fields(cls)}
        try:
            info = cls(**{k: v for k, v in d.items() if k in known})
        except TypeError as exc:
            raise ShardError(f"{source}: malformed shard entry {dict(d)!r:.200}: {exc}") from None
        ints = (info.rows, info.tokens, info.bytes, info.supervised)
        if not all(type(v) is int and v >= 0 for v in ints) or not isinstance(info.name, str):
            raise ShardError(f"{source}: malformed shard entry {dict(d)!r:.200}: counts must be ints >= 0")
        return info


@dataclass(kw_only=True, slots=True)
class Manifest:
    """Everything needed to trust, resume and train from a cache (field meanings: FORMAT.md)."""

    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION
    complete: bool = False
    target: dict[str, Any] = field(default_factory=dict)
    # What CACHE/target/ held when written (`target_files.py`): not provenance, so resumes never compare it.
    target_files: dict[str, Any] = field(default_factory=dict)
    layers: list[int] = field(default_factory=list)
    dtype: str = "bfloat16"
    hidden_size: int = 0
    codec: dict[str, Any] = field(default_factory=dict)
    dataset: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)
    tool_version: str = __version__
    skipped: list[dict[str, Any]] = field(default_factory=list)
    shards: list[ShardInfo] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["shards"] = [s.to_dict() for s in self.shards]
        return json.loads(json.dumps(d))  # deep copy; also proves it is plain JSON

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "manifest") -> Manifest:
        if not isinstance(d, Mapping):
            raise ShardError(f"{source}: expected a JSON object, got {type(d).__name__}")
        if d.get("format") != FORMAT_NAME:
            raise ShardError(
                f"{source}: format is {d.get('format')!r}, expected {FORMAT_NAME!r}: not a dflash cache"
            )
        version = d.get("version")
        if type(version) is not int or version > FORMAT_VERSION or version < 1:  # `true` is not 1
            raise ShardError(
                f"{source}: format version {version!r} is not supported by this dflash "
                f"(reads 1..{FORMAT_VERSION}); upgrade dflash to read it"
            )
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in d.items() if k in known}  # unknown keys: additions by newer minor writers
        shards = d.get("shards", [])
        if not isinstance(shards, list):
            raise ShardError(f"{source}: 'shards' must be a list")
        values["shards"] = [ShardInfo.from_dict(s, source) for s in shards]
        try:
            m = cls(**values)
        except TypeError as exc:
            raise ShardError(f"{source}: {exc}") from None
        if not isinstance(m.layers, list) or not all(type(i) is int and i >= 0 for i in m.layers):
            raise ShardError(f"{source}: 'layers' must be a list of ints >= 0, got {m.layers!r:.200}")
        for name in ("target", "codec", "dataset", "options", "plan"):
            if not isinstance(getattr(m, name), dict):
                raise ShardError(f"{source}: {name!r} must be an object, got {getattr(m, name)!r:.200}")
        m.target_files = parse_target_files(m.target_files, source)
        if type(m.complete) is not bool or type(m.hidden_size) is not int or not isinstance(m.dtype, str):
            raise ShardError(f"{source}: 'complete' must be a bool, 'hidden_size' an int, 'dtype' a string")
        if not isinstance(m.skipped, list) or not all(
            isinstance(x, dict) and type(x.get("row")) is int for x in m.skipped
        ):
            raise ShardError(f"{source}: 'skipped' must be a list of {{'row': int, 'reason': str}}")
        return m

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)


def save_manifest(cache_dir: str | os.PathLike, manifest: Manifest) -> Path:
    """Write CACHE/manifest.json atomically (`atomic.atomic_write`)."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(manifest.to_dict(), indent=1, sort_keys=False) + "\n").encode()
    return atomic_write_bytes(cache / MANIFEST_NAME, data)


def load_manifest(cache_dir: str | os.PathLike) -> Manifest:
    path = Path(cache_dir) / MANIFEST_NAME
    if not os.path.lexists(path):
        raise FileNotFoundError(
            f"{path}: no manifest: {cache_dir} is not a dflash cache (or extraction never started)"
        )
    d = load_json(read_regular(path, MAX_MANIFEST_BYTES), str(path))  # refuses FIFOs, deep nesting
    return Manifest.from_dict(d, source=str(path))


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def target_fingerprint(config_dict: Mapping[str, Any]) -> str:
    """sha256 hex of the target's config.json in canonical JSON (sorted keys, no spaces, ASCII)."""
    return hashlib.sha256(canonical_json(dict(config_dict))).hexdigest()


def target_info(config_dict: Mapping[str, Any], name_or_path: str, dtype: str = "bfloat16") -> dict[str, Any]:
    """The manifest's `target` entry (the decoder's sizes, see `decoder_config`)."""
    text = decoder_config(config_dict)
    return {
        "name_or_path": str(name_or_path),
        "model_type": config_dict.get("model_type"),
        "num_hidden_layers": text.get("num_hidden_layers"),
        "hidden_size": text.get("hidden_size"),
        "vocab_size": text.get("vocab_size"),
        "dtype": dtype,
        "config_sha256": target_fingerprint(config_dict),
    }


def _diff(prefix: str, a: Any, b: Any, out: list[str]) -> None:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in sorted(set(a) | set(b), key=str):
            name = f"{prefix}.{key}" if prefix else str(key)
            if key not in a:
                out.append(f"{name}: missing != {b[key]!r}")
            elif key not in b:
                out.append(f"{name}: {a[key]!r} != missing")
            else:
                _diff(name, a[key], b[key], out)
    elif a != b:
        out.append(f"{prefix}: {a!r} != {b!r}")


def diff_manifests(
    a: Manifest | Mapping[str, Any],
    b: Manifest | Mapping[str, Any],
    fields: Sequence[str] = PROVENANCE_FIELDS,
) -> list[str]:
    """Human-readable differences on `fields` (dotted paths allowed), e.g. "codec.name: 'lossless' != 'fp8'"."""
    da = a.to_dict() if isinstance(a, Manifest) else dict(a)
    db = b.to_dict() if isinstance(b, Manifest) else dict(b)
    out: list[str] = []
    for name in fields:
        va, vb = da, db
        for part in name.split("."):
            va = va.get(part, "missing") if isinstance(va, Mapping) else "missing"
            vb = vb.get(part, "missing") if isinstance(vb, Mapping) else "missing"
        _diff(name, va, vb, out)
    return out


def _comparable(a: Manifest, b: Manifest) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two manifests' dicts without what a resume must not compare: the target's path (the same target
    may be spelled as another path), and `weights_sha256` / the dataset's `tokens_xxh3` when one of them
    predates it."""
    da, db = a.to_dict(), b.to_dict()
    for section, never, newer in (
        ("target", ("name_or_path",), "weights_sha256"),
        ("dataset", (), "tokens_xxh3"),
    ):
        sa, sb = dict(da.get(section) or {}), dict(db.get(section) or {})
        both = newer in sa and newer in sb
        for key in never + (() if both else (newer,)):
            sa.pop(key, None)
            sb.pop(key, None)
        da[section], db[section] = sa, sb
    return da, db


def refuse_other_settings(current: Manifest, expected: Manifest, what: str) -> None:
    """A resume whose provenance differs from the cache's is refused, naming every differing field. The
    target is compared by content (config and weights fingerprints), not by the spelling of its path."""
    differences = diff_manifests(*_comparable(current, expected))
    if differences:
        raise ManifestMismatch(
            f"{what}, resume refused (use the same command or another --out); cache != this command",
            differences,
        )
