"""Reading untrusted files and writing without following links: bounded, special-file-safe, one-line errors.

- `open_regular` opens with O_NONBLOCK and checks the descriptor (fstat) is a regular file, so a FIFO,
  socket, device or directory planted where a file is expected is refused at once instead of blocking
  forever (a FIFO) or failing later with a traceback (a directory).
- `load_json` bounds the nesting depth before parsing: json's recursive decoder would otherwise raise a
  RecursionError (or, in a thread with a small stack, worse) on a few hundred KB of brackets.
- `create_new` creates a file through its directory's descriptor with O_EXCL | O_NOFOLLOW: a symlink or a
  file planted under the name makes it fail instead of writing through the link.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ShardError

MAX_JSON_DEPTH = 64  # our files nest 4 deep; HF configs and tokenizers < 10
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_ESCAPED = re.compile(rb"\\.", re.S)
_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'"[]{}')
_DEPTH_STEP = np.zeros(256, np.int8)
_DEPTH_STEP[[ord("["), ord("{")]] = 1
_DEPTH_STEP[[ord("]"), ord("}")]] = -1


def file_kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "a special file"


def open_regular(path: str | os.PathLike, what: str = "") -> int:
    """A read-only descriptor of `path`, refused (ShardError, one line) unless it is a regular file."""
    label = f"{what} {path}" if what else str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except IsADirectoryError:
        raise ShardError(f"{label} is a directory, not a file") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ShardError(f"{label} is {file_kind(mode)}, not a regular file: refusing to read it")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_regular(path: str | os.PathLike, what: str = "") -> None:
    """Refuse, before a library opens it, anything at `path` that is not a regular file (a FIFO would hang it)."""
    os.close(open_regular(path, what))


def read_regular(path: str | os.PathLike, max_bytes: int, what: str = "") -> bytes:
    """The whole of a regular file of at most `max_bytes` bytes."""
    fd = open_regular(path, what)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise ShardError(
                f"{what + ' ' if what else ''}{path}: {size} bytes, more than the {max_bytes} allowed"
            )
        chunks, total = [], 0
        while total <= max_bytes:
            chunk = os.read(fd, max(size - total, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > max_bytes:
            raise ShardError(f"{what + ' ' if what else ''}{path}: grew past {max_bytes} bytes while read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def json_depth(data: bytes) -> int:
    """Deepest nesting of arrays/objects in JSON text (brackets inside strings do not count); O(n) in numpy."""
    if b"\\" in data:
        data = _ESCAPED.sub(b"", data)  # drops escaped quotes and backslashes: strings then pair up
    s = np.frombuffer(data.translate(None, _NOT_STRUCTURE), dtype=np.uint8)
    if s.size == 0:
        return 0
    quote = s == ord('"')
    outside = (np.cumsum(quote, dtype=np.int64) & 1) == 0
    step = np.where(outside & ~quote, _DEPTH_STEP[s], 0)
    return int(np.cumsum(step, dtype=np.int64).max(initial=0))


def load_json(data: bytes | str, where: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse JSON from an untrusted source; any malformation is one ShardError naming `where`."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    # Fewer opening brackets than the limit cannot nest past it: most texts skip the O(n) scan.
    depth = json_depth(raw) if raw.count(b"[") + raw.count(b"{") > max_depth else 0
    if depth > max_depth:
        raise ShardError(f"{where}: JSON nested {depth} levels deep (at most {max_depth} allowed)")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, over-long integers
        raise ShardError(f"{where}: not valid JSON ({exc})") from None


def read_json(path: str | os.PathLike, max_bytes: int = 64 << 20, what: str = "") -> Any:
    """`load_json` of a regular file of at most `max_bytes` bytes."""
    return load_json(read_regular(path, max_bytes, what), f"{what + ' ' if what else ''}{path}")


def create_new(path: str | os.PathLike, mode: int = 0o666, *, replace_stale: bool = False) -> int:
    """A write descriptor for a file created now at `path` (O_CREAT | O_EXCL | O_NOFOLLOW, relative to its
    directory's descriptor). `replace_stale` first unlinks whatever has the name (a temp file a killed
    process left): unlinking a symlink removes the link, never its target. The umask applies to `mode`, so
    a published file gets the permissions any new file of this process gets."""
    path = Path(path)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if replace_stale:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path.name, dir_fd=dir_fd)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | os.O_CLOEXEC
        return os.open(path.name, flags, mode, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def open_nofollow(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
    """os.open relative to the parent directory's descriptor, never through a symlink at `path`; refuses
    anything that is not a regular file (checked on the descriptor, so there is no race)."""
    path = Path(path)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = os.open(path.name, flags | _NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError:
        try:
            mode_now = os.lstat(path).st_mode
        except OSError:
            mode_now = None
        if mode_now is not None and not stat.S_ISREG(mode_now):
            raise ShardError(f"{path} is {file_kind(mode_now)}: refusing to write through it") from None
        raise
    finally:
        os.close(dir_fd)
    mode_now = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode_now):
        os.close(fd)
        raise ShardError(f"{path} is {file_kind(mode_now)}, not a regular file: refusing to write it")
    os.set_blocking(fd, True)
    return fd
