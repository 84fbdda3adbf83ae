"""Open a tokenized dataset as memory-mapped Arrow columns with per-chunk numpy views.

Inputs: a HF `datasets` `save_to_disk` directory (its `data-*.arrow` IPC streams, in `state.json`
order), Arrow IPC files (file or stream format; one file or a directory of `*.arrow`), or Parquet
(one file or a directory of `*.parquet`). Arrow inputs are memory-mapped and never copied; Parquet is
compressed on disk, so its two list columns are decoded into RAM once.

Everything is columnar: lengths come from the list offsets (or the `seq_len` column), and rows are
read by slicing the values buffer of the chunk that holds them. Per-row `dataset[i]` costs ~50 us/row
and `Table.take` on a multi-chunk list column concatenates every chunk (seconds per batch), so
neither is used anywhere. Row ids are global 0-based positions in dataset order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import xxhash

from .config import ColumnNames
from .dataset_files import DatasetError, find_files, read_ipc, read_parquet

__all__ = ["ColumnNames", "DatasetError", "ListChunk", "TokenDataset", "open_dataset"]


@dataclass(frozen=True, slots=True)
class ListChunk:
    """One Arrow chunk of a list column as numpy views.

    Row i of the chunk is `values[offsets[i]:offsets[i + 1]]`. Boolean columns are bit-packed in Arrow:
    then `values` holds the packed bytes (LSB first) and element j sits at bit `bit_offset + j`.
    """

    offsets: np.ndarray  # int32 or int64, [rows + 1], absolute indices into `values`
    values: np.ndarray  # integer view of the child buffer, or packed bits (uint8) when `is_bits`
    is_bits: bool = False
    bit_offset: int = 0
    null_rows: np.ndarray | None = None  # chunk-local ids of null rows, None when there are none
    null_value_rows: np.ndarray | None = None  # chunk-local ids of rows holding a null element

    @property
    def num_rows(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets).astype(np.int64, copy=False)

    def dense(self, start: int, stop: int) -> np.ndarray:
        """Elements [start, stop) of the values as a numpy array (a view unless bit-packed)."""
        if not self.is_bits:
            return self.values[start:stop]
        lo = self.bit_offset + start
        first_byte = lo // 8
        last_byte = (self.bit_offset + stop + 7) // 8
        bits = np.unpackbits(self.values[first_byte:last_byte], bitorder="little")
        return bits[lo - 8 * first_byte : lo - 8 * first_byte + (stop - start)]


_HASH_STEP = 1 << 24  # elements per canonical copy while hashing: bounded temporaries


def _hash_values(digest: xxhash.xxh3_128, chunk: ListChunk, dtype: str) -> None:
    lo, hi = int(chunk.offsets[0]), int(chunk.offsets[-1])
    for start in range(lo, hi, _HASH_STEP):
        digest.update(np.ascontiguousarray(chunk.dense(start, min(hi, start + _HASH_STEP)), dtype))


class TokenDataset:
    """A tokenized dataset opened for columnar access. Build it with `open_dataset`."""

    def __init__(
        self,
        *,
        path: Path,
        form: str,
        files: list[Path],
        columns: ColumnNames,
        schema: pa.Schema,
        input_ids: list[ListChunk],
        loss_mask: list[ListChunk],
        seq_len_column: np.ndarray | None,
        keepalive: list[object],
    ) -> None:
        self.path = path
        self.form = form  # "save_to_disk" | "arrow" | "parquet"
        self.files = files
        self.columns = columns
        self.schema = schema
        self.input_ids = input_ids
        self.loss_mask = loss_mask
        self._keepalive = keepalive  # memory maps / tables backing the numpy views
        rows_per_chunk = np.array([c.num_rows for c in input_ids], dtype=np.int64)
        self.chunk_row_starts = np.concatenate([[0], np.cumsum(rows_per_chunk)]).astype(np.int64)
        self.num_rows = int(self.chunk_row_starts[-1])
        self.list_lengths = (
            np.concatenate([c.lengths() for c in input_ids]) if input_ids else np.zeros(0, np.int64)
        )
        self.seq_len_column = seq_len_column
        # The plan trusts `seq_len` when present; `validate` checks it against the offsets.
        self.seq_len = seq_len_column if seq_len_column is not None else self.list_lengths
        self._row_index: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._values: dict[np.dtype | None, tuple[list[np.ndarray], list[np.ndarray | None]]] = {}

    @property
    def num_chunks(self) -> int:
        return len(self.input_ids)

    def row_locations(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(chunk, start in input_ids values, start in loss_mask values) of every row; built once (~10 ms/1M rows)."""
        if self._row_index is None:
            chunk_of_row = np.repeat(
                np.arange(self.num_chunks, dtype=np.int32), np.diff(self.chunk_row_starts).astype(np.int64)
            )
            self._row_index = (chunk_of_row, _row_starts(self.input_ids), _row_starts(self.loss_mask))
        return self._row_index

    def value_views(
        self, mask_dtype: np.dtype | None = None
    ) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
        """Per-chunk values of input_ids and loss_mask (None for bit-packed masks: use `ListChunk.dense`).

        With `mask_dtype` of one byte (uint8/int8/bool), one-byte masks come as views of that dtype so
        copying them is a memcpy, not a cast (values are 0/1 once validated, so a bool view is exact).
        """
        key = np.dtype(mask_dtype) if mask_dtype is not None else None
        if key not in self._values:
            ids = [c.values for c in self.input_ids]
            masks: list[np.ndarray | None] = []
            for c in self.loss_mask:
                if c.is_bits:
                    masks.append(None)
                elif key is not None and key.itemsize == 1 and c.values.dtype.itemsize == 1:
                    masks.append(c.values.view(key))
                else:
                    masks.append(c.values)
            self._values[key] = (ids, masks)
        return self._values[key]

    def fingerprint(self) -> dict:
        """What identifies this dataset for the cache manifest. `tokens_xxh3` hashes every row's token ids and
        loss mask (~1 s per 10^8 tokens on one core, once per extraction start), so a resume or `verify
        --dataset` on a dataset re-tokenized to the same lengths and file sizes is caught, not mixed in."""
        lengths = np.ascontiguousarray(self.list_lengths, dtype="<i8")
        return {
            "form": self.form,
            "rows": self.num_rows,
            "columns": self.columns.to_dict(),
            "schema": self.schema.to_string(show_schema_metadata=False),
            "lengths_sha256": hashlib.sha256(lengths.tobytes()).hexdigest(),
            "tokens_xxh3": self.tokens_digest(),
            "files": [{"name": _relative_name(f, self.path), "bytes": f.stat().st_size} for f in self.files],
        }

    def tokens_digest(self) -> str:
        """xxh3-128 over every row's ids (little-endian int64) and loss mask (one byte a token), in row order:
        the same for the same rows whatever the files, chunking, integer width or mask encoding."""
        ids, masks = xxhash.xxh3_128(), xxhash.xxh3_128()
        for ids_chunk, mask_chunk in zip(self.input_ids, self.loss_mask, strict=True):
            _hash_values(ids, ids_chunk, "<i8")
            _hash_values(masks, mask_chunk, "u1")
        return f"{ids.hexdigest()}{masks.hexdigest()}"

    def __repr__(self) -> str:
        return f"TokenDataset({self.form}, {self.num_rows} rows, {self.num_chunks} chunks, {self.path})"


def open_dataset(path: str | Path, columns: ColumnNames | None = None) -> TokenDataset:
    """Open `path` (save_to_disk dir, Arrow IPC file/dir, Parquet file/dir) with columns `columns`."""
    columns = columns or ColumnNames()
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset not found: {path}")
    form, files = find_files(path)
    keepalive: list[object] = []
    if form == "parquet":
        tables = [read_parquet(f, columns) for f in files]
    else:
        tables = [read_ipc(f, keepalive) for f in files]
    schema = _common_schema(tables, files)
    _check_columns(schema, columns, path)
    ids_chunks: list[ListChunk] = []
    mask_chunks: list[ListChunk] = []
    seq_len_parts: list[np.ndarray] = []
    has_seq_len = columns.seq_len in schema.names
    for table in tables:
        ids_col = table.column(columns.input_ids)
        mask_col = table.column(columns.loss_mask)
        # Chunk boundaries of two columns in one table agree for IPC and Parquet reads alike.
        if [len(c) for c in ids_col.chunks] != [len(c) for c in mask_col.chunks]:
            mask_col = pa.chunked_array(_rechunk(mask_col, [len(c) for c in ids_col.chunks]), mask_col.type)
        ids_chunks.extend(_list_chunk(c) for c in ids_col.chunks)
        mask_chunks.extend(_list_chunk(c) for c in mask_col.chunks)
        if has_seq_len:
            seq_len_parts.append(_int_column(table.column(columns.seq_len), columns.seq_len))
    keepalive.extend(tables)
    seq_len = None
    if has_seq_len:
        seq_len = np.concatenate(seq_len_parts) if seq_len_parts else np.zeros(0, np.int64)
    return TokenDataset(
        path=path,
        form=form,
        files=files,
        columns=columns,
        schema=schema,
        input_ids=ids_chunks,
        loss_mask=mask_chunks,
        seq_len_column=seq_len,
        keepalive=keepalive,
    )


def _common_schema(tables: list[pa.Table], files: list[Path]) -> pa.Schema:
    schema = tables[0].schema.remove_metadata()
    for table, file in zip(tables[1:], files[1:], strict=True):
        other = table.schema.remove_metadata()
        if not other.equals(schema):
            diff = [
                f"{name}: {_type_of(other, name)} vs {_type_of(schema, name)}"
                for name in dict.fromkeys([*other.names, *schema.names])
                if _type_of(other, name) != _type_of(schema, name)
            ]
            raise DatasetError(f"{file}: schema differs from {files[0].name} ({'; '.join(diff)})")
    return schema


def _type_of(schema: pa.Schema, name: str) -> str:
    return str(schema.field(name).type) if name in schema.names else "missing"


# --- columns as numpy -----------------------------------------------------------------------------


def _check_columns(schema: pa.Schema, columns: ColumnNames, path: Path) -> None:
    for name in (columns.input_ids, columns.loss_mask):
        if name not in schema.names:
            raise DatasetError(
                f"column {name!r}: missing from {path} (columns: {', '.join(schema.names)}); "
                "name the right one with --input-ids-column/--loss-mask-column"
            )
        kind = schema.field(name).type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
            raise DatasetError(f"column {name!r}: type {kind} is not a list of integers")
        value_type = kind.value_type
        allowed = pa.types.is_integer(value_type) or (
            name == columns.loss_mask and pa.types.is_boolean(value_type)
        )
        if not allowed:
            want = "integers or booleans" if name == columns.loss_mask else "integers"
            raise DatasetError(f"column {name!r}: type {kind} is not a list of {want}")
    if columns.seq_len in schema.names and not pa.types.is_integer(schema.field(columns.seq_len).type):
        raise DatasetError(
            f"column {columns.seq_len!r}: type {schema.field(columns.seq_len).type} is not an integer"
        )


def _list_chunk(array: pa.Array) -> ListChunk:
    offsets = array.offsets.to_numpy()  # sliced arrays: absolute offsets into the (unsliced) child
    child = array.values
    if pa.types.is_boolean(child.type):
        buffer = child.buffers()[1]
        packed = np.frombuffer(buffer, dtype=np.uint8) if buffer is not None else np.zeros(0, np.uint8)
        values, is_bits, bit_offset = packed, True, child.offset
    else:
        values, is_bits, bit_offset = child.to_numpy(zero_copy_only=False), False, 0
    null_rows = null_value_rows = None
    if array.null_count:
        null_rows = np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))
    if child.null_count and len(offsets) and offsets[-1] > offsets[0]:
        region = child.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        if region.null_count:
            where = np.flatnonzero(region.is_null().to_numpy(zero_copy_only=False)) + int(offsets[0])
            null_value_rows = np.unique(np.searchsorted(offsets, where, side="right") - 1)
    return ListChunk(
        offsets=offsets,
        values=values,
        is_bits=is_bits,
        bit_offset=bit_offset,
        null_rows=null_rows,
        null_value_rows=null_value_rows,
    )


def _row_starts(chunks: list[ListChunk]) -> np.ndarray:
    if not chunks:
        return np.zeros(0, np.int64)
    return np.concatenate([c.offsets[:-1].astype(np.int64) for c in chunks])


def _int_column(column: pa.ChunkedArray, name: str) -> np.ndarray:
    if column.null_count:
        nulls = np.concatenate([c.is_null().to_numpy(zero_copy_only=False) for c in column.chunks])
        first = int(np.flatnonzero(nulls)[0])
        raise DatasetError(f"column {name!r}: row {first} is null ({column.null_count} null rows)")
    parts = [c.to_numpy(zero_copy_only=False) for c in column.chunks]
    return np.concatenate(parts).astype(np.int64, copy=False) if parts else np.zeros(0, np.int64)


def _rechunk(column: pa.ChunkedArray, sizes: list[int]) -> list[pa.Array]:
    out, start = [], 0
    for size in sizes:
        out.append(column.slice(start, size).combine_chunks())
        start += size
    return out


def _relative_name(file: Path, root: Path) -> str:
    try:
        return str(file.relative_to(root)) if root.is_dir() else file.name
    except ValueError:
        return file.name
