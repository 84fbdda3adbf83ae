"""The shards a staging directory has handed to object storage (`CACHE/.published.jsonl`), so that its local copies
can be deleted: a cache bigger than the node's disk is extracted through a staging directory that holds only
the shards not yet uploaded (`publish.Publisher`).

    {"name": "shard-000012.dfs", "info": {...ShardInfo...}, "skipped": [{"row": int, "reason": str}, ...]}

one line per shard, appended and fsynced (a line cut short by a crash is ignored: its shard, still here, is
uploaded again).
A shard is recorded only once its object is up whole, and its local file is deleted only after that record is
durable; so a name here is committed (`paths.committed_shard_names` counts it), its manifest entry comes from
here (`info`), and so do the rows its writer left out (`skipped`, the index's `meta.skipped`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .errors import ShardError
from .manifest import ShardInfo
from .paths import unit_of_shard
from .safe_io import load_json, open_nofollow, read_regular

LEDGER_NAME = ".published.jsonl"
MAX_LEDGER_BYTES = 1 << 30


def published_shards(cache_dir: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """name -> {"info": ShardInfo, "skipped": [...]} of the shards recorded as uploaded (none: {})."""
    path = Path(cache_dir) / LEDGER_NAME
    if not os.path.lexists(path):
        return {}
    lines = read_regular(path, MAX_LEDGER_BYTES, "published-shards ledger").split(b"\n")
    out = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = load_json(line, f"{path}:{number}")
        except ShardError:  # a line cut short by a crash while appended: its shard is still here, sent again
            continue
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or unit_of_shard(name) is None:
            raise ShardError(f"{path}:{number}: malformed entry")
        skipped = entry.get("skipped", [])
        out[name] = {
            "info": ShardInfo.from_dict(entry.get("info"), f"{path}:{number}"),
            "skipped": [
                {"row": r["row"], "reason": r["reason"]}
                for r in (skipped if isinstance(skipped, list) else [])
                if isinstance(r, dict) and type(r.get("row")) is int and isinstance(r.get("reason"), str)
            ],
        }
    return out


def record_published(cache_dir: str | os.PathLike, name: str, info: ShardInfo, skipped: list) -> None:
    """Append shard `name`'s record, durably (one writer: the publisher)."""
    line = json.dumps({"name": name, "info": info.to_dict(), "skipped": list(skipped)}) + "\n"
    path = Path(cache_dir) / LEDGER_NAME
    fd = open_nofollow(path, os.O_RDWR | os.O_CREAT | os.O_APPEND)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":  # after a line cut short: start a new one
            line = "\n" + line
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
