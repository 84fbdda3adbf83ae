"""`verify_cache`: decode every frame and check index, footer, manifest and row coverage agree.

The full check (the default) decompresses every frame: token ids inside the target's vocabulary, a 0/1
loss mask whose ones match the index's `supervised`, frame sizes matching the index's `length`, and
hidden states free of NaN/inf (counted from the exponent bits, without building the float output).
`quick=True` only re-hashes the stored bytes (what `verify` did before decoding existed). Either way each
shard's header must match the manifest (codec, layers, dtype, width: `Cache.shard` checks it, as for
training) and `target/` must hold what training reads (config, embedding, lm_head headers), byte for byte
what its writer recorded (`target_files`, when the manifest has them), with JSON objects in its JSON files.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .cache import Cache
from .codecs import zstd_decompress_exact
from .errors import CorruptFrame, ShardError
from .layout import checksum
from .manifest import ShardInfo
from .progress import progress_bar
from .reader import ShardReader
from .target_config import CONFIG_NAME
from .target_files import json_problems, target_file_problems
from .target_parts import FROZEN_NAME, check_target_parts, target_dir
from .trust import ReadLimits

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
    decoded_bytes: int = 0  # what the frames decompress to (0 with quick=True)
    quick: bool = False
    bad_shards: dict[str, list[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    # With a dataset: its rows as stored / skipped / missing, and which fingerprint fields were compared.
    dataset: dict[str, Any] | None = None

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
            "decoded_bytes": self.decoded_bytes,
            "quick": self.quick,
            "bad_shards": self.bad_shards,
            "problems": self.problems,
            "dataset": self.dataset,
        }


def _rows_text(rows: list[int]) -> str:
    shown = ", ".join(map(str, rows[:_SHOW]))
    return f"{len(rows)} rows ({shown}{', ...' if len(rows) > _SHOW else ''})"


# The dataset fingerprint fields `verify --dataset` compares, and what each one stands for.
_FINGERPRINT = {
    "rows": ("row count", "row count differs"),
    "lengths_sha256": ("row lengths", "row lengths differ"),
    "tokens_xxh3": ("token ids and loss masks", "token ids or loss masks differ"),
}


def _dataset_differences(recorded: Mapping[str, Any], given: Mapping[str, Any]) -> list[str]:
    """The fingerprint fields on which the given dataset is not the one the cache was extracted from (a field
    the manifest predates is not compared)."""
    return [
        f"the dataset's {text} from the dataset this cache was extracted from "
        f"(manifest dataset.{key} {recorded[key]!r}, the dataset's {given.get(key)!r})"
        for key, (_, text) in _FINGERPRINT.items()
        if key in recorded and recorded[key] != given.get(key)
    ]


def _target_problems(cache: Cache) -> list[str]:
    """What training reads besides the shards: every file of target/ against the manifest's digests, the
    JSON files as objects, config, embedding and lm_head headers (values at training). One line per file:
    a file that is not the one written is not checked further."""
    directory = target_dir(cache.path)
    problems = target_file_problems(directory, cache.manifest.target_files)
    if directory.is_dir():
        problems |= {k: v for k, v in json_problems(directory).items() if k not in problems}
    if not {CONFIG_NAME, FROZEN_NAME} & problems.keys():
        try:
            check_target_parts(cache.path)
        except (ShardError, OSError, ValueError) as exc:
            return [*problems.values(), str(exc)]
    return list(problems.values())


def _check_sample(reader: ShardReader, i: int, limits: ReadLimits) -> tuple[list[str], int]:
    """Problems of sample i found by decoding each frame, and the bytes its frames decode to."""
    entry = reader.entries[i]
    s, h = entry.length, reader.hidden_size
    problems, decoded = [], 0
    for k, buf in enumerate(reader.raw_frames(i)):
        offset, length, digest = entry.frames[k]
        where = (
            f"{reader.path}: sample {i} (row {entry.row}) frame {reader.frame_name(k)} at {offset}+{length}"
        )
        if checksum(buf) != digest:
            problems.append(f"{where}: checksum mismatch")
            continue
        try:
            if k == 0:
                ids = np.frombuffer(zstd_decompress_exact(buf, 4 * s, "input_ids"), dtype="<i4")
                decoded += ids.nbytes
                problem = limits.ids_problem(ids)
                if problem:
                    problems.append(f"{where}: {problem}")
            elif k == 1:
                mask = np.frombuffer(zstd_decompress_exact(buf, s, "loss_mask"), dtype=np.uint8)
                decoded += mask.nbytes
                ones = int(np.count_nonzero(mask))
                if int(mask.max()) > 1:
                    problems.append(f"{where}: loss_mask holds values other than 0/1")
                elif ones != entry.supervised:
                    problems.append(f"{where}: {ones} supervised tokens, the index says {entry.supervised}")
            else:
                bad = reader.codec.nonfinite(buf, (s, h), reader.dtype)
                decoded += reader.codec.decoded_bytes(s, h, reader.dtype)
                if bad:
                    problems.append(f"{where}: {bad} non-finite (NaN/inf) values")
        except CorruptFrame as exc:
            problems.append(
                f"{where}: {exc} (the index's length {s} does not match the frame, or it is corrupt)"
            )
    return problems, decoded


def _check_shard(reader: ShardReader, report: VerifyReport, limits: ReadLimits) -> None:
    if report.quick:
        for problem in reader.verify():
            report.add(reader.name, problem)
        return
    for i in range(len(reader.entries)):
        try:
            problems, decoded = _check_sample(reader, i, limits)
        except ShardError as exc:  # the file shrank under us
            problems, decoded = [str(exc)], 0
        report.decoded_bytes += decoded
        for problem in problems:
            report.add(reader.name, problem)


def verify_cache(
    cache: Cache,
    dataset_rows: int | None = None,
    *,
    quick: bool = False,
    dataset: Mapping[str, Any] | None = None,
) -> VerifyReport:
    """Check every shard (every frame decoded, or only re-hashed with `quick`; index, footer, manifest
    stats) and, given the dataset's row count, that each row 0..dataset_rows-1 is stored exactly once or
    listed in the manifest's `skipped`. Given the dataset's fingerprint (`dataset`, what the extractor
    records), its rows, lengths and tokens must be the ones the cache was extracted from."""
    m = cache.manifest
    report = VerifyReport(cache=cache.location, complete=m.complete, quick=quick)
    compared: list[str] = []
    differences: list[str] = []
    if dataset is not None:
        dataset_rows = int(dataset["rows"]) if dataset_rows is None else dataset_rows
        differences = _dataset_differences(m.dataset, dataset)
        report.problems.extend(differences)
        compared = [name for key, (name, _) in _FINGERPRINT.items() if key in m.dataset]
    report.problems.extend(_target_problems(cache))
    if not m.complete:
        report.problems.append(
            f"{cache.location}: cache is incomplete (manifest complete=false): extraction unfinished"
        )
    listed: dict[str, ShardInfo] = {s.name: s for s in m.shards} if m.complete else {}
    if m.complete:
        on_disk = set(cache.committed_names())
        for extra in sorted(on_disk - set(listed)):
            report.add(extra, f"{cache.where(extra)}: committed shard not listed in the manifest")
        if len(listed) != len(m.shards):
            report.problems.append(f"{cache.location}/manifest.json: a shard is listed more than once")
    where: dict[int, list[str]] = {}
    progress = progress_bar("verify", len(cache.shard_names), "shard")  # minutes on a large cache
    for name in cache.shard_names:
        progress.update(1)
        path = cache.where(name)
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
        _check_shard(reader, report, cache.limits)
        if name in listed:
            want, got = listed[name].to_dict(), reader.info().to_dict()
            for key in want:
                if want[key] != got[key]:
                    report.add(name, f"{path}: {key} is {got[key]!r} but the manifest says {want[key]!r}")
        for e in reader.entries:
            where.setdefault(e.row, []).append(name)
    progress.close()
    if sum(len(v) for v in where.values()) != len(where):
        dups = sorted(r for r, names in where.items() if len(names) > 1)
        for r in dups[:_SHOW]:
            report.problems.append(
                f"row {r} stored {len(where[r])} times (in {', '.join(sorted(set(where[r])))})"
            )
        if len(dups) > _SHOW:
            report.problems.append(f"{len(dups)} rows are stored more than once in all")
    if m.complete and not where and not m.options.get("allow_empty"):
        report.problems.append(
            f"{cache.location}: holds no samples (an empty dataset, or every row skipped: {len(m.skipped)} "
            "skipped); extract with --allow-empty if that is intended"
        )
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
        report.dataset = {
            "rows": dataset_rows,
            "stored": sum(1 for r, names in where.items() if r < dataset_rows and len(names) == 1),
            "skipped": sum(
                1 for r in skipped if isinstance(r, int) and 0 <= r < dataset_rows and r not in where
            ),
            "missing": len(missing),
            "fingerprint_checked": compared,
            "fingerprint_matches": not differences,
        }
    return report
