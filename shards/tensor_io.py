"""The one call to safetensors' `save_file` (checkpoints, exports, a cache's frozen target parts).

safetensors (0.8) writes through a temp file of its own, created mode 0600, and reports I/O failures as a
multi-line `SafetensorError` ("Error while serializing: I/O error: No space left on device (os error 28)").
So a file it writes is given the mode any other new file gets (0o666 less the umask: a server running as
another user can read an exported drafter), and an I/O failure becomes the `OSError` it was, naming the
file, which every command reports in one line (a full disk: `shards/cli.py`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from .errors import ShardError

_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def new_file_mode() -> int:
    """The permissions `open()` gives a new file in this process: 0o666 less the umask."""
    try:  # Linux says it without changing it (os.umask would, for every thread, for a moment)
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            mask = next((int(line.split()[1], 8) for line in f if line.startswith("Umask:")), None)
    except (OSError, ValueError, IndexError):
        mask = None
    if mask is None:
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def save_tensors(
    tensors: Mapping[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None
) -> None:
    """`save_file(tensors, path, metadata)`, then the umask's mode. An I/O failure is an `OSError` with its
    errno and `path`; any other refusal of safetensors one `ShardError` line naming `path`."""
    try:
        save_file(dict(tensors), str(path), metadata=metadata)
    except SafetensorError as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        code = _OS_ERROR.search(text)
        if code is not None:
            number = int(code.group(1))
            raise OSError(number, os.strerror(number), str(path)) from None
        raise ShardError(f"{path}: cannot write a safetensors file: {text}") from None
    os.chmod(Path(path), new_file_mode())
