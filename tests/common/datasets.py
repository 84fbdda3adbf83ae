"""Small tokenized datasets for tests, in every input form `open_dataset` reads.

Rows are (input_ids, loss_mask) numpy pairs; writers take the rows plus layout options (chunk size,
number of files, dtypes, with/without seq_len) so tests can cover multi-chunk and multi-file inputs.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pyarrow as pa

Row = tuple[np.ndarray, np.ndarray]
INT32, INT8 = pa.int32(), pa.int8()


def make_rows(
    n: int,
    *,
    seed: int = 0,
    min_len: int = 1,
    max_len: int = 64,
    vocab: int = 1000,
    empty: tuple[int, ...] = (),
    unsupervised: tuple[int, ...] = (),
) -> list[Row]:
    """`n` random rows; a prompt part (mask 0) then a response (mask 1). `empty`/`unsupervised`: row ids forced so."""
    rng = np.random.default_rng(seed)
    rows: list[Row] = []
    for r in range(n):
        length = 0 if r in empty else int(rng.integers(min_len, max_len + 1))
        ids = rng.integers(0, vocab, size=length, dtype=np.int64)
        prompt = int(rng.integers(0, max(length, 1)))
        mask = (np.arange(length) >= prompt).astype(np.int64)
        if r in unsupervised:
            mask[:] = 0
        rows.append((ids, mask))
    return rows


def to_table(
    rows: list[Row],
    *,
    ids_type: pa.DataType = INT32,
    mask_type: pa.DataType = INT8,
    seq_len: bool = True,
    large: bool = False,
    names: tuple[str, str, str] = ("input_ids", "loss_mask", "seq_len"),
) -> pa.Table:
    """Rows as one Arrow table (single chunk) built from flat buffers, no per-row Python lists."""
    lengths = np.array([len(ids) for ids, _ in rows], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    flat_ids = np.concatenate([ids for ids, _ in rows]) if rows else np.zeros(0, np.int64)
    flat_mask = np.concatenate([m for _, m in rows]) if rows else np.zeros(0, np.int64)
    list_type = pa.LargeListArray if large else pa.ListArray
    off = pa.array(offsets, pa.int64() if large else pa.int32())
    columns = {
        names[0]: list_type.from_arrays(off, pa.array(flat_ids).cast(ids_type)),
        names[1]: list_type.from_arrays(
            off,
            pa.array(flat_mask.astype(bool) if pa.types.is_boolean(mask_type) else flat_mask).cast(mask_type),
        ),
    }
    if seq_len:
        columns[names[2]] = pa.array(lengths, pa.int64())
    return pa.table(columns)


def _batches(table: pa.Table, rows_per_batch: int) -> list[pa.RecordBatch]:
    return [b for b in table.to_batches(max_chunksize=rows_per_batch)] or [
        pa.RecordBatch.from_pylist([], schema=table.schema)
    ]


def _split(table: pa.Table, num_files: int) -> list[pa.Table]:
    bounds = np.linspace(0, table.num_rows, num_files + 1).astype(int)
    return [table.slice(a, b - a) for a, b in itertools.pairwise(bounds)]


def write_save_to_disk(
    rows: list[Row], path: Path, *, num_files: int = 1, rows_per_batch: int = 1000, **table_kw
) -> Path:
    """The `datasets` save_to_disk layout (data-*.arrow IPC streams + state.json), written with pyarrow."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    table = to_table(rows, **table_kw)
    names = []
    for k, part in enumerate(_split(table, num_files)):
        name = f"data-{k:05d}-of-{num_files:05d}.arrow"
        with pa.OSFile(str(path / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in _batches(part, rows_per_batch):
                writer.write_batch(batch)
        names.append(name)
    state = {
        "_data_files": [{"filename": n} for n in names],
        "_fingerprint": "test",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    (path / "state.json").write_text(json.dumps(state, indent=2))
    (path / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return path


def write_hf_dataset(rows: list[Row], path: Path, *, num_shards: int = 2) -> Path:
    """A real `datasets.Dataset.save_to_disk` directory (python lists -> list<int64> columns)."""
    import datasets

    data = {
        "input_ids": [ids.tolist() for ids, _ in rows],
        "loss_mask": [m.tolist() for _, m in rows],
        "seq_len": [len(ids) for ids, _ in rows],
    }
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict(data).save_to_disk(str(path), num_shards=num_shards)
    return Path(path)


def _file_paths(path: Path, num_files: int, suffix: str) -> list[Path]:
    """`path` itself when one file is asked for and `path` ends in `suffix`, else numbered parts inside the
    directory `path`; parent directories are created."""
    if num_files == 1 and path.suffix == suffix:
        path.parent.mkdir(parents=True, exist_ok=True)
        return [path]
    path.mkdir(parents=True, exist_ok=True)
    return [path / f"part-{k:03d}{suffix}" for k in range(num_files)]


def write_arrow(
    rows: list[Row],
    path: Path,
    *,
    num_files: int = 1,
    rows_per_batch: int = 1000,
    stream: bool = False,
    **table_kw,
) -> Path:
    """Arrow IPC: one file at `path` when num_files == 1 and path ends in .arrow, else a directory of files."""
    path = Path(path)
    table = to_table(rows, **table_kw)
    targets = _file_paths(path, num_files, ".arrow")
    for target, part in zip(targets, _split(table, num_files), strict=True):
        opener = pa.ipc.new_stream if stream else pa.ipc.new_file
        with pa.OSFile(str(target), "wb") as sink, opener(sink, table.schema) as writer:
            for batch in _batches(part, rows_per_batch):
                writer.write_batch(batch)
    return path


def write_parquet(
    rows: list[Row], path: Path, *, num_files: int = 1, row_group_size: int = 1000, **table_kw
) -> Path:
    """Parquet: one file at `path` when num_files == 1 and path ends in .parquet, else a directory of files."""
    import pyarrow.parquet as pq

    path = Path(path)
    table = to_table(rows, **table_kw)
    targets = _file_paths(path, num_files, ".parquet")
    for target, part in zip(targets, _split(table, num_files), strict=True):
        pq.write_table(part, str(target), row_group_size=row_group_size)
    return path


def write_target_config(
    path: Path,
    *,
    num_hidden_layers: int = 36,
    hidden_size: int = 4096,
    vocab_size: int = 151936,
    wrapped: bool = False,
) -> Path:
    """A target directory holding only config.json (Qwen3-like, or the VLM-wrapped qwen3_5 layout)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    text = {"num_hidden_layers": num_hidden_layers, "hidden_size": hidden_size, "vocab_size": vocab_size}
    if wrapped:
        config = {
            "model_type": "qwen3_5",
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "text_config": {"model_type": "qwen3_5_text", **text},
            "vision_config": {"depth": 2},
        }
    else:
        config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **text}
    (path / "config.json").write_text(json.dumps(config))
    return path


def write_ones_stream(path: Path, lengths: list[int]) -> Path:
    """A dataset folder holding one bare Arrow IPC stream (no state.json): rows of `lengths` ones, loss mask all
    ones. The smallest thing `verify --dataset` reads."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rows = [[1] * n for n in lengths]
    table = pa.table({"input_ids": rows, "loss_mask": rows})
    with (
        pa.OSFile(str(path / "data-00000-of-00001.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as w,
    ):
        w.write_table(table)
    return path
