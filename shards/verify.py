"""`verify_cache`: re-hash every frame and check index, footer, manifest and row coverage agree."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .errors import ShardError
from .manifest import ShardInfo
from .paths import SHARDS_DIR
from .reader import Cache

_SHOW = 20  # rows listed per problem line; the count is always exact


@dataclass(kw_only=True, slots=True)
class VerifyReport:
    """Problems by shard (`bad_shards`) and cache-wide (`problems`); `ok` only if both are empty."""

    cache: str
    complete: bool
    shards_checked: int = 0
    samples_checked: int = 0
    frames_checked: int = 0
    bytes_checked: int = 0
    bad_shards: dict[str, list[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad_shards and not self.problems

    def add(self, shard: str, problem: str) -> None:
        self.bad_shards.setdefault(shard, []).append(problem)

    def lines(self) -> list[str]:
        return [*self.problems, *(p for ps in self.bad_shards.values() for p in ps)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "cache": self.cache,
            "complete": self.complete,
            "shards_checked": self.shards_checked,
            "samples_checked": self.samples_checked,
            "frames_checked": self.frames_checked,
            "bytes_checked": self.bytes_checked,
            "bad_shards": self.bad_shards,
            "problems": self.problems,
        }


def _rows_text(rows: list[int]) -> str:
    shown = ", ".join(map(str, rows[:_SHOW]))
    return f"{len(rows)} rows ({shown}{', ...' if len(rows) > _SHOW else ''})"


def _check_against_manifest(cache: Cache, reader: Any, report: VerifyReport) -> None:
    m = cache.manifest
    name = reader.name
    if reader.codec.to_dict() != m.codec:
        report.add(name, f"{reader.path}: codec {reader.codec.to_dict()} != manifest codec {m.codec}")
    if reader.layers != m.layers:
        report.add(name, f"{reader.path}: layers {reader.layers} != manifest layers {m.layers}")
    if reader.dtype != m.dtype:
        report.add(name, f"{reader.path}: dtype {reader.dtype} != manifest dtype {m.dtype}")
    if m.hidden_size and reader.hidden_size != m.hidden_size:
        report.add(name, f"{reader.path}: hidden_size {reader.hidden_size} != manifest {m.hidden_size}")


def verify_cache(cache: Cache, dataset_rows: int | None = None) -> VerifyReport:
    """Check every shard (frame checksums, index, footer, manifest stats) and, given the dataset's row
    count, that each row 0..dataset_rows-1 is stored exactly once or listed in the manifest's `skipped`."""
    m = cache.manifest
    report = VerifyReport(cache=str(cache.path), complete=m.complete)
    if not m.complete:
        report.problems.append(
            f"{cache.path}: cache is incomplete (manifest complete=false): extraction unfinished"
        )
    listed: dict[str, ShardInfo] = {s.name: s for s in m.shards} if m.complete else {}
    if m.complete:
        on_disk = {p.name for p in (cache.path / SHARDS_DIR).glob("shard-*.dfs")}
        for extra in sorted(on_disk - set(listed)):
            report.add(
                extra, f"{cache.path / SHARDS_DIR / extra}: committed shard not listed in the manifest"
            )
        if len(listed) != len(m.shards):
            report.problems.append(f"{cache.path}/manifest.json: a shard is listed more than once")
    where: dict[int, list[str]] = {}
    for name in cache.shard_names:
        path = cache.path / SHARDS_DIR / name
        try:
            reader = cache.shard(name)
        except FileNotFoundError:
            report.add(name, f"{path}: listed in the manifest but missing")
            continue
        except ShardError as exc:
            report.add(name, str(exc))
            continue
        report.shards_checked += 1
        report.samples_checked += len(reader.entries)
        report.frames_checked += sum(len(e.frames) for e in reader.entries)
        report.bytes_checked += reader.file_size
        for problem in reader.verify():
            report.add(name, problem)
        _check_against_manifest(cache, reader, report)
        if name in listed:
            want, got = listed[name].to_dict(), reader.info().to_dict()
            for key in want:
                if want[key] != got[key]:
                    report.add(name, f"{path}: {key} is {got[key]!r} but the manifest says {want[key]!r}")
        for e in reader.entries:
            where.setdefault(e.row, []).append(name)
    if sum(len(v) for v in where.values()) != len(where):
        dups = sorted(r for r, names in where.items() if len(names) > 1)
        for r in dups[:_SHOW]:
            report.problems.append(
                f"row {r} stored {len(where[r])} times (in {', '.join(sorted(set(where[r])))})"
            )
        if len(dups) > _SHOW:
            report.problems.append(f"{len(dups)} rows are stored more than once in all")
    skipped = Counter(s.get("row") for s in m.skipped if isinstance(s, dict))
    both = sorted(r for r in skipped if r in where)
    if both:
        report.problems.append(f"stored AND listed as skipped: {_rows_text(both)}")
    if dataset_rows is not None:
        missing = [r for r in range(dataset_rows) if r not in where and r not in skipped]
        if missing:
            report.problems.append(f"missing from the cache and not skipped: {_rows_text(missing)}")
        beyond = sorted(r for r in where if r >= dataset_rows)
        if beyond:
            report.problems.append(f"rows beyond the dataset's {dataset_rows} rows: {_rows_text(beyond)}")
    return report
