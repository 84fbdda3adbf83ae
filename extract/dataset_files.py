"""Where a tokenized dataset's files are and how each is read (`dataset.open_dataset` builds on them): a
`datasets` save_to_disk directory (in `state.json` order; a one-split DatasetDict too), Arrow IPC files (file or
stream format) or Parquet, one file or a directory of them. Dataset metadata never makes dflash read outside
the dataset's directory."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
from dflash.shards.errors import ShardError
from dflash.shards.safe_io import check_regular, read_json

from .config import ColumnNames


class DatasetError(ShardError, ValueError):
    """The dataset is malformed: the message names the column, the first offending rows and the fix."""


def find_files(path: Path) -> tuple[str, list[Path]]:
    if path.is_file():
        if path.suffix == ".parquet":
            return "parquet", [path]
        return "arrow", [path]
    if os.path.lexists(path / "dataset_dict.json"):
        meta = read_json(path / "dataset_dict.json", max_bytes=1 << 20, what="dataset")
        splits = meta.get("splits", []) if isinstance(meta, dict) else None
        if not isinstance(splits, list) or not all(isinstance(n, str) for n in splits):
            raise DatasetError(f"{path / 'dataset_dict.json'}: 'splits' must be a list of names")
        if len(splits) == 1:
            return find_files(_inside(path, splits[0], "dataset_dict.json"))
        raise ValueError(
            f"{path} is a DatasetDict with splits {splits}; pass one split directory, e.g. {path / splits[0]}"
            if splits
            else f"{path} is a DatasetDict without splits"
        )
    state = path / "state.json"
    if os.path.lexists(state):
        try:
            names = [entry["filename"] for entry in read_json(state, 16 << 20, "dataset")["_data_files"]]
        except (KeyError, TypeError) as exc:
            raise DatasetError(f"{state}: not a datasets save_to_disk state file ({exc!r})") from None
        files = [_inside(path, name, "state.json") for name in names]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise DatasetError(f"{path}: state.json lists missing data files {missing[:3]}")
        for f in files:
            check_regular(f, "dataset file")  # a FIFO would block the memory map forever
        return "save_to_disk", files
    arrow = sorted(p for p in path.rglob("*.arrow") if p.is_file())
    parquet = sorted(p for p in path.rglob("*.parquet") if p.is_file())
    if arrow and parquet:
        raise ValueError(f"{path} holds both .arrow and .parquet files; point --dataset at one kind")
    if arrow:
        return "arrow", arrow
    if parquet:
        return "parquet", parquet
    raise ValueError(
        f"{path}: no dataset found (expected a datasets save_to_disk directory, *.arrow or *.parquet files)"
    )


def _inside(root: Path, name: object, source: str) -> Path:
    """root/name, refused unless `name` is a relative path that stays inside `root` (no `..`, not absolute):
    dataset metadata must not make dflash read files elsewhere."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise DatasetError(f"{root / source}: {name!r} points outside the dataset directory {root}")
    return root / name


def read_ipc(file: Path, keepalive: list[object]) -> pa.Table:
    source = pa.memory_map(str(file), "r")
    keepalive.append(source)
    try:
        try:
            return pa.ipc.open_file(source).read_all()
        except pa.ArrowInvalid:
            source.seek(0)
            return pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid as exc:
        raise DatasetError(f"{file}: not an Arrow IPC file or stream ({exc})") from exc
    except OSError as exc:  # pyarrow's reads past the end of a cut-short stream are plain OSErrors
        raise DatasetError(f"{file}: damaged or truncated Arrow data ({exc})") from exc


def read_parquet(file: Path, columns: ColumnNames) -> pa.Table:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(str(file), memory_map=True)
    except pa.ArrowException as exc:
        raise DatasetError(f"{file}: not a Parquet file ({exc})") from exc
    names = parquet.schema_arrow.names
    wanted = [c for c in (columns.input_ids, columns.loss_mask, columns.seq_len) if c in names]
    return parquet.read(columns=wanted)
