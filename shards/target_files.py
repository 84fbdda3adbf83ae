"""What `CACHE/target/` held when written: each file's size and xxh3-128 (the manifest's `target_files`).

    {"config.json": {"bytes": 1234, "xxh3_128": "<32 hex digits>"}, "frozen.safetensors": {...}, ...}

Why: bytes zeroed or flipped inside frozen.safetensors are finite weights nobody can tell from real ones;
training would learn against a damaged embedding and lm_head and ship a drafter made for them. So the
writer of target/ (extraction, convert) records every file, and verify, training and convert compare:
a file missing, of another size or digest, or present but not recorded is one line naming it. A manifest
without `target_files` (caches from before it) is not compared, as `dataset.tokens_xxh3` is not.

xxh3-128 over an mmap of the file: ~12 GB/s from the page cache on one core of the test box, against
~2 GB/s for read() + hash (the copy dominates), so a 2.5 GB untied Qwen3-8B table costs ~0.2 s.
"""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

from .errors import ShardError
from .paths import TARGET_DIR
from .safe_io import open_regular, read_json

HASH = "xxh3_128"
_CHUNK = 64 << 20  # hashed per mmap slice, so a huge file never needs one contiguous view
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}$")  # a plain file name: no path, no dotfile
_HEX = re.compile(r"^[0-9a-f]{32}$")
_MAX_JSON_BYTES = 256 << 20  # tokenizer.json of the largest vocabularies is tens of MB
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}
FIX = (
    "restore it from a copy of the cache, or re-run the dflash-extract (or dflash-shards convert) command "
    "that wrote the cache: it rewrites target/"
)


def is_plain_name(name: str) -> bool:
    """A file name target/ may hold: no path, no dotfile."""
    return bool(_NAME.match(name))


def _digest_fd(fd: int, size: int) -> str:
    h = xxhash.xxh3_128()
    if size:  # mmap refuses a length of 0
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as m:
            view = memoryview(m)
            try:
                for start in range(0, size, _CHUNK):
                    h.update(view[start : start + _CHUNK])
            finally:
                view.release()
    return h.hexdigest()


def file_digest(path: str | os.PathLike) -> dict[str, Any]:
    """{"bytes", "xxh3_128"} of a regular file (anything else is refused in one line, never waited on)."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        return {"bytes": size, HASH: _digest_fd(fd, size)}
    finally:
        os.close(fd)


def digest_files(directory: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The `target_files` record of every file in `directory` (dotfiles aside), by name."""
    names = sorted(p.name for p in Path(directory).iterdir() if not p.name.startswith("."))
    return {name: file_digest(Path(directory) / name) for name in names}


def parse_target_files(value: Any, source: str) -> dict[str, dict[str, Any]]:
    """A manifest's `target_files`, refused in one line unless every name is a plain file name (it is joined
    to target/ and opened) and every entry holds `bytes` (int >= 0) and, when present, a 32-hex `xxh3_128`."""
    if not isinstance(value, dict):
        raise ShardError(f"{source}: 'target_files' must be an object, got {value!r:.80}")
    for name, entry in value.items():
        if not _NAME.match(name):
            raise ShardError(f"{source}: target_files name {name!r:.80} is not a plain file name")
        sized = isinstance(entry, dict) and type(entry.get("bytes")) is int and entry["bytes"] >= 0
        digest = entry.get(HASH, "") if sized else ""
        if not sized or (HASH in entry and not (isinstance(digest, str) and _HEX.match(digest))):
            raise ShardError(
                f"{source}: target_files.{name} must be {{'bytes': int >= 0, '{HASH}': 32 hex digits}}, "
                f"got {entry!r:.120}"
            )
    return value


def _file_problem(path: Path, want: Mapping[str, Any]) -> str | None:
    if not os.path.lexists(path):
        return f"{path}: missing, the manifest records it"
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        damaged = f"{path}: damaged or replaced since written"
        if size != want["bytes"]:
            return f"{damaged} ({size} bytes, the manifest recorded {want['bytes']})"
        # An entry with only a size (its hash under a name a newer writer uses) is held to its size.
        got = _digest_fd(fd, size) if HASH in want else None
        if got != want.get(HASH):
            return f"{damaged} ({HASH} {got}, the manifest recorded {want[HASH]})"
        return None
    finally:
        os.close(fd)


def target_file_problems(directory: str | os.PathLike, recorded: Mapping[str, Any]) -> dict[str, str]:
    """name -> one line (naming the file and the fix) for each file of `directory` that differs from
    `recorded`: missing, another size or digest, not a regular file, or present but not recorded. Empty
    when all agree, and when nothing is recorded (a cache from before `target_files`)."""
    if not recorded:
        return {}
    directory = Path(directory)
    problems: dict[str, str] = {}
    for name, want in sorted(recorded.items()):
        try:
            problem = _file_problem(directory / name, want)
        except (ShardError, OSError) as exc:
            problem = str(exc)
        if problem:
            problems[name] = f"{problem}; {FIX}"
    if directory.is_dir():
        for path in sorted(directory.iterdir()):
            if path.name not in recorded and not path.name.startswith("."):
                problems[path.name] = (
                    f"{path}: added since written (not in the manifest's target_files); {FIX}"
                )
    return problems


def check_target_files(cache_dir: str | os.PathLike, recorded: Mapping[str, Any]) -> None:
    """Refuse (ShardError, one line naming each file) a CACHE/target/ that differs from `recorded`."""
    problems = target_file_problems(Path(cache_dir) / TARGET_DIR, recorded)
    if problems:
        raise ShardError("; ".join(problems.values()))


def json_problems(directory: str | os.PathLike) -> dict[str, str]:
    """name -> one line for each `*.json` of `directory` that is not a JSON object (`null`, a list, invalid
    JSON): config, tokenizer and generation files are all objects, and their readers index into them."""
    problems: dict[str, str] = {}
    for path in sorted(Path(directory).glob("*.json")):
        if path.name.startswith("."):
            continue
        try:
            data = read_json(path, max_bytes=_MAX_JSON_BYTES)
        except (ShardError, OSError) as exc:
            problems[path.name] = str(exc)
            continue
        if not isinstance(data, dict):
            problems[path.name] = f"{path}: holds JSON {_JSON_KINDS.get(type(data), 'null')}, not an object"
    return problems
