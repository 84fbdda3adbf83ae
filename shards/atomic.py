"""Crash-safe writes, the one way the project commits a file or a directory.

A file is written under a hidden temp name beside its final name, fsynced, renamed over the final
name, and the directory is fsynced, so after a crash (or a power cut) the final name holds the old
content or the new one, never a torn mix. A directory is built the same way and swapped in whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .safe_io import create_new


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


# A file another host's process is writing (a home directory on NFS that every node stages into) cannot be
# checked by pid: it counts as abandoned once it has not changed for this long. A download in flight writes
# continuously; a reservation lives as long as its download.
FOREIGN_STALE_S = 3600.0


def host_tag() -> str:
    """This host, as 8 hex digits: names of files in flight carry it beside the pid, so that processes of
    other hosts sharing a directory neither write one temp file nor take each other's for abandoned."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def owner() -> str:
    """`PID-HOST` of this process, the owner part of an in-flight file's name (`owner_gone` reads it)."""
    return f"{os.getpid()}-{host_tag()}"


def owner_gone(pid: int, host: str | None, path: Path) -> bool:
    """Whether the writer of in-flight file `path` (pid `pid` of host tag `host`; None: a name from before
    host tags, taken as this host's) is gone: by pid on this host, by `path`'s age elsewhere."""
    if host is None or host == host_tag():
        return not process_alive(pid)
    try:
        return time.time() - path.lstat().st_mtime > FOREIGN_STALE_S
    except FileNotFoundError:
        return True


def temp_path(final: Path) -> Path:
    """The hidden temp name a write to `final` goes through (`.NAME.tmp-PID-HOST-THREAD`): two threads, or
    two hosts' processes of one pid, writing one final name never share a temp file (the second would replace
    the first's as stale)."""
    return final.with_name(f".{final.name}.tmp-{owner()}-{threading.get_native_id()}")


def left_by_dead_process(path: Path) -> bool:
    """Whether `path` is a temp file (`temp_path`'s name) whose writing process is gone: safe to remove. One
    that a live process is writing is not (several processes, of one host or several, may write into one
    directory)."""
    head, sep, owner_part = path.name.rpartition(".tmp-")
    fields = owner_part.split("-")
    if not (head.startswith(".") and sep and fields[0].isdigit()):
        return False
    host = fields[1] if len(fields) == 3 else None  # PID-HOST-THREAD; before host tags PID or PID-THREAD
    return owner_gone(int(fields[0]), host, path)


def process_alive(pid: int) -> bool:
    """Whether a process of this host has `pid` (another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def discard(path: Path) -> None:
    """Remove whatever is at `path` without following a link there: a link or a file is unlinked (never
    what a link points to), a directory is removed with its content."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], Any]) -> Path:
    """`write(tmp)` writes the content to the temp path it is given; then fsync, rename, fsync the directory.

    The temp file is created here first, exclusively and never through a link (`safe_io.create_new`): a
    link or file planted under the temp name is removed, not written through, so `write` only ever
    opens a regular file this process created."""
    final = Path(path)
    tmp = temp_path(final)
    try:
        os.close(create_new(tmp, replace_stale=True))
        write(tmp)
        _fsync_file(tmp)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(final.parent)
    return final


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_json(path: str | os.PathLike, obj: Any, *, sort_keys: bool = False) -> Path:
    """`obj` as indented JSON with a final newline."""
    return atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=sort_keys) + "\n").encode())


def fresh_temp_dir(final: str | os.PathLike) -> Path:
    """An empty temp directory (`temp_path(final)`) to build `final` in; whatever a killed writer or anyone
    else left under that name is discarded first (a planted link is removed, never followed)."""
    tmp = temp_path(Path(final))
    discard(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> Path:
    """Swap the fully written directory `tmp` in as `final` (replacing an older `final`).

    Every file in `tmp` is fsynced first. An older `final` is parked as `.NAME.old` until the new one
    is in place, so a crash in between leaves one of the two (`restore_parked_dir` puts it back)."""
    tmp, final = Path(tmp), Path(final)
    for child in tmp.iterdir():
        if child.is_file():
            _fsync_file(child)
    fsync_dir(tmp)
    old = parked_dir(final)
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)
    return final


def parked_dir(final: Path) -> Path:
    return final.with_name(f".{final.name}.old")


def restore_parked_dir(old: Path) -> Path | None:
    """After a crash inside `commit_dir`: put a parked `.NAME.old` back when NAME is missing, else drop it.
    Returns the restored path (None when nothing had to be restored)."""
    final = old.with_name(old.name[1 : -len(".old")])
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        return None
    os.rename(old, final)
    return final
