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
from dflash.shards.safe_io import open_regular

_SAMPLE = 1 << 20
_MAX_HEADER = 100 << 20  # safetensors' own limit


def weights_fingerprint(target: str | os.PathLike) -> str | None:
    """sha256 hex over the target's safetensors files (see the module docstring); None without any."""
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
            h.update(f"{path.name}\0{size}\0".encode())
            h.update(os.pread(fd, n, 8))
            h.update(os.pread(fd, min(_SAMPLE, size - data), data))
            h.update(os.pread(fd, min(_SAMPLE, size - data), max(data, size - _SAMPLE)))
        finally:
            os.close(fd)
    return h.hexdigest()
