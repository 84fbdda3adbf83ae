"""The last training record under a run folder: `python bench/last_step.py DIR` prints "STEP TOKENS_PER_S"
from the newest metrics.jsonl below DIR ("0 0" while there is none). The device scripts' progress lines."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def last_record(root: Path) -> dict:
    files = sorted(root.rglob("metrics.jsonl"), key=lambda p: p.stat().st_mtime)
    for line in reversed(files[-1].read_text().splitlines() if files else []):
        try:
            return json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
    return {}


if __name__ == "__main__":
    record = last_record(Path(sys.argv[1]))
    print(record.get("step", 0), round(record.get("tokens_per_s", 0)))
