"""open_dataset: every input form (save_to_disk, Arrow IPC file/stream, Parquet), multi-chunk, several files."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
from dflash.extract.config import ColumnNames
from dflash.extract.dataset import DatasetError, _list_chunk, open_dataset

from tests.common.datasets import (
    make_rows,
    to_table,
    write_arrow,
    write_hf_dataset,
    write_parquet,
    write_save_to_disk,
)

ROWS = make_rows(230, seed=1, empty=(4, 229))

FORMS = {
    "save_to_disk_3files_chunks17": lambda p: write_save_to_disk(
        ROWS, p / "ds", num_files=3, rows_per_batch=17
    ),
    "hf_datasets_2shards": lambda p: write_hf_dataset(ROWS, p / "hf", num_shards=2),
    "arrow_file_dir_4files": lambda p: write_arrow(ROWS, p / "arrow", num_files=4, rows_per_batch=20),
    "arrow_stream_single": lambda p: write_arrow(ROWS, p / "one.arrow", stream=True, rows_per_batch=50),
    "arrow_large_list_no_seq_len": lambda p: write_arrow(ROWS, p / "l.arrow", large=True, seq_len=False),
    "parquet_dir_3files": lambda p: write_parquet(ROWS, p / "pq", num_files=3, row_group_size=25),
    "parquet_single_bool_mask": lambda p: write_parquet(ROWS, p / "x.parquet", mask_type=pa.bool_()),
    "arrow_bool_mask_int64_ids": lambda p: write_arrow(
        ROWS, p / "b", num_files=2, rows_per_batch=13, mask_type=pa.bool_(), ids_type=pa.int64()
    ),
}


def row_content(ds, row: int) -> tuple[np.ndarray, np.ndarray]:
    chunk, ids_start, mask_start = (a[row] for a in ds.row_locations())
    n = int(ds.list_lengths[row])
    ids = ds.input_ids[chunk].values[ids_start : ids_start + n]
    return ids, ds.loss_mask[chunk].dense(mask_start, mask_start + n)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_form_reads_every_row(tmp_path, form):
    ds = open_dataset(FORMS[form](tmp_path))
    assert ds.num_rows == len(ROWS)
    expected = np.array([len(ids) for ids, _ in ROWS])
    np.testing.assert_array_equal(ds.seq_len, expected)
    np.testing.assert_array_equal(ds.list_lengths, expected)
    assert ds.seq_len.dtype == np.int64
    for r, (ids, mask) in enumerate(ROWS):
        got_ids, got_mask = row_content(ds, r)
        np.testing.assert_array_equal(got_ids, ids)
        np.testing.assert_array_equal(got_mask.astype(np.int64), mask)


def test_multi_chunk_and_files_are_in_dataset_order(tmp_path):
    ds = open_dataset(write_save_to_disk(ROWS, tmp_path / "ds", num_files=3, rows_per_batch=17))
    assert len(ds.files) == 3 and [f.name for f in ds.files] == sorted(f.name for f in ds.files)
    assert ds.num_chunks > 10
    assert ds.chunk_row_starts[0] == 0 and ds.chunk_row_starts[-1] == len(ROWS)
    assert ds.form == "save_to_disk"


def test_save_to_disk_follows_state_json_order(tmp_path):
    path = write_save_to_disk(ROWS, tmp_path / "ds", num_files=2)
    state = json.loads((path / "state.json").read_text())
    state["_data_files"].reverse()
    (path / "state.json").write_text(json.dumps(state))
    ds = open_dataset(path)
    second_file_rows = ds.num_rows - 115
    np.testing.assert_array_equal(row_content(ds, 0)[0], ROWS[115][0])
    np.testing.assert_array_equal(row_content(ds, second_file_rows)[0], ROWS[0][0])


def test_seq_len_derived_from_offsets_when_column_absent(tmp_path):
    ds = open_dataset(write_arrow(ROWS, tmp_path / "a.arrow", seq_len=False))
    assert ds.seq_len_column is None
    np.testing.assert_array_equal(ds.seq_len, [len(i) for i, _ in ROWS])


def test_custom_column_names(tmp_path):
    path = write_arrow(ROWS, tmp_path / "a.arrow", names=("ids", "mask", "n"))
    ds = open_dataset(path, ColumnNames(input_ids="ids", loss_mask="mask", seq_len="n"))
    assert ds.seq_len_column is not None
    np.testing.assert_array_equal(row_content(ds, 7)[0], ROWS[7][0])


def test_sliced_list_array_keeps_absolute_offsets():
    table = to_table(ROWS[:20])
    sliced = table.column("input_ids").chunk(0).slice(5, 10)
    chunk = _list_chunk(sliced)
    assert chunk.num_rows == 10
    for i in range(10):
        np.testing.assert_array_equal(chunk.values[chunk.offsets[i] : chunk.offsets[i + 1]], ROWS[5 + i][0])


def test_bool_bits_with_offset_decode():
    bits = pa.array([True, False, True, True, False, False, True, False, True, True, True], pa.bool_())
    arr = pa.ListArray.from_arrays(pa.array([0, 3, 11], pa.int32()), bits).slice(1, 1)
    chunk = _list_chunk(arr)
    start, stop = int(chunk.offsets[0]), int(chunk.offsets[1])
    np.testing.assert_array_equal(chunk.dense(start, stop), [1, 0, 0, 1, 0, 1, 1, 1])


def test_fingerprint_is_stable_and_tracks_lengths(tmp_path):
    a = open_dataset(write_save_to_disk(ROWS, tmp_path / "a", num_files=2)).fingerprint()
    b = open_dataset(write_save_to_disk(ROWS, tmp_path / "b", num_files=2)).fingerprint()
    assert a == b
    assert {"rows", "schema", "columns", "lengths_sha256", "files"} <= a.keys()
    assert a["rows"] == len(ROWS) and len(a["files"]) == 2 and all(f["bytes"] > 0 for f in a["files"])
    changed = [(ids[:-1], m[:-1]) if r == 9 else (ids, m) for r, (ids, m) in enumerate(ROWS)]
    c = open_dataset(write_save_to_disk(changed, tmp_path / "c", num_files=2)).fingerprint()
    assert c["lengths_sha256"] != a["lengths_sha256"]
    json.dumps(a)


def test_dataset_dict_single_split_is_used_and_several_refused(tmp_path):
    root = tmp_path / "dd"
    write_save_to_disk(ROWS, root / "train")
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    assert open_dataset(root).num_rows == len(ROWS)
    write_save_to_disk(ROWS[:5], root / "test")
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(ValueError, match=r"DatasetDict with splits \['train', 'test'\]; pass one split"):
        open_dataset(root)


def test_missing_path_and_empty_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset not found"):
        open_dataset(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no dataset found"):
        open_dataset(tmp_path / "empty")


def test_not_arrow_file_is_refused(tmp_path):
    bad = tmp_path / "junk.arrow"
    bad.write_bytes(b"this is not arrow at all")
    with pytest.raises(DatasetError, match="not an Arrow IPC file or stream"):
        open_dataset(bad)


def test_files_with_different_schemas_are_refused(tmp_path):
    d = tmp_path / "mixed"
    d.mkdir()
    write_arrow(ROWS[:10], d / "a.arrow")
    write_arrow(ROWS[10:20], d / "b.arrow", ids_type=pa.int64())
    with pytest.raises(DatasetError, match=r"b\.arrow: schema differs"):
        open_dataset(d)
