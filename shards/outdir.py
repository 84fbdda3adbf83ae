"""The one `--out` rule of dflash-extract, dflash-train and dflash-train export.

`--out` must be a new directory, an empty one (dotfiles count: `.git` is content), or one dflash wrote for
the same purpose. dflash marks every directory it claims with `.dflash` (`{"kind": ...}`) before writing
anything else, so temp-file cleanup, pruning and overwrites only ever happen in marked directories.
Directories written before the mark existed are recognized by their content (a cache's manifest, a
run's step checkpoints, an export's config). Nothing is ever written inside a cache except by extraction.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import time
from pathlib import Path

from . import __version__
from .errors import ShardError
from .safe_io import create_new, file_kind, read_json

MARK_NAME = ".dflash"
KINDS = ("cache", "run", "export")
_WHAT = {"cache": "hidden-state cache", "run": "training run", "export": "drafter export"}
_STEP_DIR = re.compile(r"^step_\d{6,}$")


def _read_mark(path: Path) -> str | None:
    mark = path / MARK_NAME
    if not os.path.lexists(mark):
        return None
    for _ in range(50):  # empty: created this instant by a command started together with this one
        with contextlib.suppress(OSError):
            if os.lstat(mark).st_size:
                break
        time.sleep(0.02)
    try:
        d = read_json(mark, max_bytes=1 << 16)
    except ShardError as exc:
        raise ShardError(f"{exc} (a dflash directory mark)") from None
    kind = d.get("kind") if isinstance(d, dict) else None
    if kind not in KINDS:
        raise ShardError(f"{mark}: unknown directory kind {kind!r} (expected one of {list(KINDS)})")
    return kind


def _legacy_kind(path: Path) -> str | None:
    """What an unmarked directory written by an older dflash is, from its content; None if not ours."""
    manifest = path / "manifest.json"
    if manifest.is_file():
        try:
            d = read_json(manifest, max_bytes=256 << 20)
        except (ShardError, OSError):
            d = None
        if isinstance(d, dict) and d.get("format") == "dflash-cache":
            return "cache"
    checkpoints = path / "checkpoints"
    if checkpoints.is_dir() and any(
        _STEP_DIR.match(c.name) and (c / "meta.json").is_file() for c in checkpoints.iterdir()
    ):
        return "run"
    config = path / "config.json"
    if config.is_file() and (path / "dflash.py").is_file():
        try:
            d = read_json(config, max_bytes=1 << 20)
        except (ShardError, OSError):
            d = None
        if isinstance(d, dict) and d.get("architectures") == ["DFlashDraftModel"]:
            return "export"
    return None


def owner_kind(path: str | os.PathLike) -> str | None:
    """The kind of dflash directory `path` is (`cache`, `run`, `export`), or None if dflash did not write it."""
    path = Path(path)
    return _read_mark(path) or _legacy_kind(path)


def enclosing_cache(path: str | os.PathLike) -> Path | None:
    """The nearest proper ancestor of `path` that is a dflash cache, if any."""
    for parent in Path(os.path.abspath(path)).parents:
        try:
            if owner_kind(parent) == "cache":
                return parent
        except (ShardError, OSError):
            continue
    return None


def _check(path: Path, kind: str, flag: str) -> tuple[bool, bool]:
    """(exists, marked) after refusing what the rule forbids; see `claim_out_dir`."""
    if kind not in KINDS:
        raise ValueError(f"unknown output kind {kind!r}")
    cache = enclosing_cache(path)
    if cache is not None:
        raise ValueError(
            f"{flag} {path} is inside the dflash cache {cache}: only dflash-extract writes into a cache; "
            f"choose a {_WHAT[kind]} directory outside it"
        )
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False, False
    if not stat.S_ISDIR(mode):
        raise ValueError(f"{flag} {path} is {file_kind(mode)}, not a directory: choose a new directory")
    names = sorted(os.listdir(path))
    if not names:
        return True, False
    owner = owner_kind(path)
    if owner is None:
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise ValueError(
            f"{flag} {path} is not empty ({shown}) and was not written by dflash: refusing to write into it; "
            "choose a new or empty directory"
        )
    if owner != kind:
        raise ValueError(
            f"{flag} {path} holds a dflash {_WHAT[owner]}, not a {_WHAT[kind]}: choose another directory"
        )
    return True, MARK_NAME in names


def _write_mark(path: Path, kind: str) -> None:
    try:
        fd = create_new(path / MARK_NAME)
    except FileExistsError:  # another process of the same command claimed it first: same rule applies
        if _read_mark(path) != kind:
            raise ValueError(f"{path} was claimed by another dflash command meanwhile") from None
        return
    with os.fdopen(fd, "wb") as f:
        f.write(json.dumps({"kind": kind, "tool_version": __version__}).encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())


def claim_out_dir(path: str | os.PathLike, kind: str, flag: str = "--out") -> Path:
    """Make `path` this command's output directory of `kind`, or refuse (ValueError, one line) when it is a
    file, a non-empty directory dflash did not write (dotfiles count), a dflash directory of another kind,
    or inside a cache. Creates and marks a new or empty directory; an existing one of `kind` is kept."""
    path = Path(path)
    exists, marked = _check(path, kind, flag)
    if not exists:
        path.mkdir(parents=True, exist_ok=True)
    if not marked:
        _write_mark(path, kind)
    return path


def check_out_dir(path: str | os.PathLike, kind: str, flag: str = "--out") -> bool:
    """`claim_out_dir`'s refusals without writing: True when `path` is already a dflash `kind` directory."""
    path = Path(path)
    exists, _ = _check(path, kind, flag)
    return exists and owner_kind(path) == kind


def raise_if_not_ours(path: str | os.PathLike, kind: str) -> None:
    """Guard for deleting files: refuse unless `path` is a dflash directory of `kind`."""
    if owner_kind(path) != kind:
        raise ShardError(f"{path} is not a dflash {_WHAT[kind]} directory: refusing to delete anything in it")
