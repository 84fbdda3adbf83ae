"""What identifies a target by content, so a resume compares targets, not the spelling of their path.

The manifest's `target` records `name_or_path` for people; a resume compares `config_sha256` and
`weights_sha256` (`dflash.shards.manifest.refuse_other_settings`): the sha256 of every safetensors file's name, size, header (tensor names, dtypes,
shapes, offsets) and first and last MiB of data. Reading a few MiB per file keeps it cheap for a
multi-GB checkpoint, and a fine-tune of the same architecture changes the sampled bytes.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

from dflash.shards.errors import ShardError
from dflash.shards.safe_io import load_json, open_regular

_SAMPLE = 1 << 20
_MAX_HEADER = 100 << 20  # safetensors' own limit


def _check_covered(path: Path, header: bytes, data_bytes: int) -> None:
    """Refuse a safetensors file whose tensors do not end where the file does: one cut short (an interrupted
    download or copy) would otherwise pass until the target is loaded, after the cache was started."""
    info = load_json(header, f"{path} (safetensors header)")
    if not isinstance(info, dict):
        raise ShardError(f"{path}: not a safetensors file (its header is not a JSON object)")
    ends = [
        v["data_offsets"][1]
        for k, v in info.items()
        if k != "__metadata__"
        and isinstance(v, dict)
        and isinstance(v.get("data_offsets"), list)
        and len(v["data_offsets"]) == 2
        and type(v["data_offsets"][1]) is int
    ]
    described = max(ends, default=0)
    if described != data_bytes:
        state = "cut short" if described > data_bytes else "longer than its header says"
        raise ShardError(
            f"{path}: damaged safetensors file, {state} (its tensors need {described:,} bytes of data, the "
            f"file holds {data_bytes:,}): an interrupted download or copy? fetch the target again"
        )


def weights_fingerprint(target: str | os.PathLike) -> str | None:
    """sha256 hex over the target's safetensors files (see the module docstring); None without any. A file
    cut short is refused here, before `--out` is claimed."""
    files = sorted(Path(target).glob("*.safetensors"))
    if not files:
        return None
    h = hashlib.sha256()
    for path in files:
        fd = open_regular(path, "target weights")
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, 8, 0)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
            if n is None or n > min(_MAX_HEADER, size - 8):
                raise ShardError(f"{path}: not a safetensors file (header length {n} of a {size}-byte file)")
            data = 8 + n
            header = os.pread(fd, n, 8)
            _check_covered(path, header, size - data)
            h.update(f"{path.name}\0{size}\0".encode())
            h.update(header)
            h.update(os.pread(fd, min(_SAMPLE, size - data), data))
            h.update(os.pread(fd, min(_SAMPLE, size - data), max(data, size - _SAMPLE)))
        finally:
            os.close(fd)
    return h.hexdigest()
