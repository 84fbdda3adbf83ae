"""Who may write a cache directory, and what a killed writer leaves behind.

One process holds an exclusive fcntl lock on a file in the directory for as long as it writes (opened
without following links, so a planted link is refused rather than truncated); `is_held` lets others see
it. While the lock is held, temp files and directories of killed writers can be removed safely, and only
in a directory dflash marked as a cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from .atomic import discard
from .errors import ShardError
from .outdir import raise_if_not_ours
from .paths import SHARDS_DIR
from .safe_io import load_json, open_nofollow, read_regular


class FileLock:
    """An exclusive fcntl lock on one file, held until release(); content describes the holder."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    def acquire(self, retry_seconds: float = 0.0) -> bool:
        # Never through a symlink, never a FIFO: a planted link must not be truncated by write().
        fd = open_nofollow(self.path, os.O_RDWR | os.O_CREAT)
        deadline = time.monotonic() + retry_seconds
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._fd = fd
                return True
            except OSError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return False
                time.sleep(0.1)

    def write(self, info: dict[str, Any]) -> None:
        assert self._fd is not None
        data = json.dumps(info).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        os.fsync(self._fd)

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.lockf(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


class Locked(ShardError):
    """Another process holds the lock of the directory a command was about to write."""


def take_lock(path: Path, busy: str, **fields: Any) -> FileLock:
    """Hold `path`'s lock for this process, describing it by `fields` (e.g. `command`), or refuse in one
    line: `busy` (what the directory is being used for), then the holder. The kernel drops an fcntl lock
    when its process dies, so a killed holder never blocks the next command."""
    lock = FileLock(path)
    if not lock.acquire():
        raise _refusal(path, busy)
    lock.write(holder_info(**fields))
    return lock


def refuse_if_held(path: Path, busy: str) -> None:
    """`take_lock`'s refusal without taking the lock (a dry run's check): Locked when another holds `path`."""
    if is_held(path):
        raise _refusal(path, busy)


def _refusal(path: Path, busy: str) -> Locked:
    info: dict[str, Any] = {}
    for _ in range(20):  # the holder writes its description right after it locks
        info = read_holder(path)
        if info:
            break
        time.sleep(0.05)
    return Locked(
        f"{busy} ({holder_text(info)}; lock {path.name}); wait for it to finish or choose another --out"
    )


def holder_info(**fields: Any) -> dict[str, Any]:
    """What a lock's file says about its holder: pid, host and start time, plus `fields`."""
    return {"pid": os.getpid(), "host": socket.gethostname(), **fields, "since": time.time()}


def read_holder(path: Path) -> dict[str, Any]:
    """The holder a lock file describes ({} when it cannot be read: the holder had not written it yet)."""
    try:
        info = load_json(read_regular(path, 1 << 16) or b"{}", str(path))
    except (OSError, ShardError):
        return {}
    return info if isinstance(info, dict) else {}


def holder_text(info: dict[str, Any]) -> str:
    """`pid 123 on host, command ..., since ...` for a refusal message (the fields the holder wrote)."""
    if not info:
        return "another process"
    extra = [f"{k.replace('_', ' ')} {info[k]}" for k in ("command", "world_size") if k in info]
    if isinstance(info.get("since"), (int, float)):
        extra.append("since " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"])))
    return ", ".join([f"pid {info.get('pid')} on {info.get('host')}", *extra])


def is_held(path: Path) -> bool:
    """True when some other process holds an fcntl lock on `path` (probes with a shared lock)."""
    try:
        fd = open_nofollow(path, os.O_RDONLY)
    except (FileNotFoundError, ShardError):
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def remove_stale_temp_files(cache_dir: str | os.PathLike) -> int:
    """Delete temp files and directories of killed writers (call it holding the cache's lock)."""
    from .target_parts import stale_target_dirs  # torch-importing modules: only when cleaning
    from .writer import stale_temp_files

    raise_if_not_ours(cache_dir, "cache")
    n = 0
    for p in stale_temp_files(Path(cache_dir) / SHARDS_DIR):
        p.unlink(missing_ok=True)
        n += 1
    for p in stale_target_dirs(cache_dir):
        discard(p)  # a planted link is removed, never followed
    return n
