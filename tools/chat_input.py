"""Open chat data for `dflash-tokenize`: JSONL, Parquet or a `save_to_disk` dataset -> one `datasets.Dataset`.

JSONL is staged as raw lines (one Arrow string column) and parsed inside the parallel map, so one bad
line, or a field whose JSON type changes from row to row, is a counted skip instead of a schema
error that stops the whole load. Parquet is staged column-only; a `save_to_disk` dataset is used in
place. Staged Arrow files go to a scratch directory the caller owns (never the HF cache).
"""

from __future__ import annotations

import gzip
import io
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
from dflash.shards.errors import ShardError
from dflash.shards.safe_io import load_json

from .chat import FORMATS

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
PARQUET_SUFFIXES = (".parquet",)
_STAGE_ROWS = 8192
_PEEK_LINES = 200


@dataclass(frozen=True, slots=True)
class ChatSource:
    """An opened input: `dataset` has one column, `column`; `kind` says how to read it."""

    dataset: object  # datasets.Dataset
    column: str
    form: str  # "jsonl" | "parquet" | "save_to_disk"
    key: str  # "messages" | "conversations"
    files: tuple[str, ...]

    @property
    def raw_lines(self) -> bool:
        return self.form == "jsonl"


def _suffix_kind(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


def _resolve_files(path: Path) -> tuple[str, list[Path]]:
    if not path.exists():
        raise FileNotFoundError(f"--data {path}: no such file or directory")
    if path.is_dir():
        if (path / "dataset_dict.json").exists():
            splits = sorted(p.name for p in path.iterdir() if p.is_dir())
            raise ValueError(
                f"--data {path} is a DatasetDict; point --data at one split ({', '.join(splits)})"
            )
        if (path / "state.json").exists() or (path / "dataset_info.json").exists():
            return "save_to_disk", [path]
        files = sorted(p for p in path.iterdir() if p.is_file() and _suffix_kind(p))
        kinds = {_suffix_kind(p) for p in files}
        if not files:
            raise ValueError(
                f"--data {path}: no .jsonl/.json/.parquet files and not a datasets save_to_disk directory"
            )
        if len(kinds) > 1:
            raise ValueError(f"--data {path} mixes JSONL and Parquet files; point --data at one kind")
        return kinds.pop(), files
    kind = _suffix_kind(path)
    if kind is None:
        raise ValueError(
            f"--data {path}: unknown file type (expected .jsonl, .json, .jsonl.gz, .parquet "
            "or a datasets save_to_disk directory)"
        )
    return kind, [path]


def _choose_key(available: set[str], fmt: str, where: str) -> str:
    if fmt != "auto":
        if fmt not in available:
            raise ValueError(f"--data {where} has no {fmt!r} column/key (found: {sorted(available)[:10]})")
        return fmt
    for key in FORMATS:
        if key in available:
            return key
    raise ValueError(
        f"--data {where} has no 'messages' or 'conversations' column/key (found: {sorted(available)[:10]}); "
        "chat data must be OpenAI-style messages or ShareGPT-style conversations"
    )


def _open_text(path: Path) -> io.TextIOBase:
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8-sig", errors="replace")
    return path.open("r", encoding="utf-8-sig", errors="replace")  # -sig: drop a leading BOM


def _peek_json_keys(files: list[Path]) -> set[str]:
    keys: set[str] = set()
    for path in files:
        with _open_text(path) as f:
            seen = 0
            for line in f:
                stripped = line.strip()
                if not stripped:
                    continue
                if seen == 0 and stripped.startswith("["):
                    raise ValueError(
                        f"--data {path} holds a JSON array; convert it to JSON lines (one object per line)"
                    )
                seen += 1
                try:
                    row = load_json(stripped, str(path))
                except ShardError:
                    continue  # counted as invalid_json later
                if isinstance(row, dict):
                    keys.update(row)
                if seen >= _PEEK_LINES:
                    break
    return keys


def _write_stream(path: Path, batches) -> int:
    """Write Arrow record batches as an IPC stream (the format `Dataset.from_file` maps); returns rows."""
    rows = 0
    writer = None
    try:
        for batch in batches:
            if writer is None:
                writer = pa.ipc.new_stream(str(path), batch.schema)
            writer.write_batch(batch)
            rows += batch.num_rows
    finally:
        if writer is not None:
            writer.close()
    return rows


def _jsonl_batches(files: list[Path]):
    schema = pa.schema([("line", pa.large_string())])
    lines: list[str] = []
    for path in files:
        with _open_text(path) as f:
            for line in f:
                if line.strip():
                    lines.append(line)
                if len(lines) >= _STAGE_ROWS:
                    yield pa.record_batch([pa.array(lines, pa.large_string())], schema=schema)
                    lines = []
    if lines:
        yield pa.record_batch([pa.array(lines, pa.large_string())], schema=schema)


def _parquet_batches(files: list[Path], key: str):
    import pyarrow.parquet as pq

    schema = None
    for path in files:
        pf = pq.ParquetFile(path)
        for batch in pf.iter_batches(columns=[key], batch_size=_STAGE_ROWS):
            if schema is None:
                schema = batch.schema
            elif batch.schema != schema:
                raise ValueError(
                    f"--data {path}: column {key!r} type differs from the first file's ({schema})"
                )
            yield batch


def open_chat_source(path: str | Path, fmt: str, scratch: Path) -> ChatSource:
    """Open `path` and pick its conversation column (`fmt`: auto, messages or conversations)."""
    import datasets

    path = Path(path)
    form, files = _resolve_files(path)
    if form == "save_to_disk":
        ds = datasets.load_from_disk(str(path))
        if not isinstance(ds, datasets.Dataset):
            raise ValueError(f"--data {path} is a DatasetDict; point --data at one split")
        key = _choose_key(set(ds.column_names), fmt, str(path))
        return ChatSource(ds.select_columns([key]), key, form, key, (str(path),))
    scratch.mkdir(parents=True, exist_ok=True)
    staged = scratch / "input.arrow"
    if form == "jsonl":
        key = _choose_key(_peek_json_keys(files), fmt, str(path))
        rows = _write_stream(staged, _jsonl_batches(files))
        column = "line"
    else:
        import pyarrow.parquet as pq

        names = set(pq.ParquetFile(files[0]).schema_arrow.names)
        key = _choose_key(names, fmt, str(files[0]))
        rows = _write_stream(staged, _parquet_batches(files, key))
        column = key
    if rows == 0:
        raise ValueError(f"--data {path} holds no rows")
    return ChatSource(datasets.Dataset.from_file(str(staged)), column, form, key, tuple(map(str, files)))
