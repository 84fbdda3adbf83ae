"""validate: each malformed case fails with its own one-line message; skips are counted exactly."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from dflash.extract.dataset import DatasetError, open_dataset
from dflash.extract.validate import REASONS, _segment_sums, validate
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.common.datasets import make_rows, write_arrow, write_save_to_disk

VOCAB = 1000


def rows_with(n: int = 60, **kw):
    return make_rows(n, seed=3, min_len=4, max_len=30, vocab=VOCAB, **kw)


def open_rows(tmp_path, rows, **kw):
    return open_dataset(write_save_to_disk(rows, tmp_path / "ds", num_files=2, rows_per_batch=7, **kw))


def write_table(tmp_path, table: pa.Table):
    path = tmp_path / "t.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=9)
    return path


def list_col(rows, t=None):
    return pa.array([list(map(int, r)) for r in rows], pa.list_(t or pa.int32()))


# --- fatal cases ----------------------------------------------------------------------------------


def test_missing_column(tmp_path):
    path = write_table(tmp_path, pa.table({"input_ids": list_col([[1, 2]]), "labels": list_col([[1, 1]])}))
    with pytest.raises(
        DatasetError, match=r"^column 'loss_mask': missing from .* \(columns: input_ids, labels\)"
    ):
        open_dataset(path)


def test_wrong_type_float_ids(tmp_path):
    table = pa.table({"input_ids": list_col([[1.5]], pa.float32()), "loss_mask": list_col([[1]])})
    with pytest.raises(
        DatasetError, match=r"^column 'input_ids': type list<item: float> is not a list of integers"
    ):
        open_dataset(write_table(tmp_path, table))


def test_wrong_type_string_column(tmp_path):
    table = pa.table({"input_ids": pa.array(["hello"]), "loss_mask": list_col([[1]])})
    with pytest.raises(DatasetError, match=r"^column 'input_ids': type string is not a list of integers"):
        open_dataset(write_table(tmp_path, table))


def test_wrong_type_seq_len(tmp_path):
    table = pa.table({"input_ids": list_col([[1]]), "loss_mask": list_col([[1]]), "seq_len": pa.array([1.0])})
    with pytest.raises(DatasetError, match=r"^column 'seq_len': type double is not an integer"):
        open_dataset(write_table(tmp_path, table))


def test_seq_len_disagrees_with_lists(tmp_path):
    rows = rows_with()
    ds = open_rows(tmp_path, rows)
    ds.seq_len_column[[3, 20, 21]] += 1
    with pytest.raises(DatasetError) as err:
        validate(ds, vocab_size=VOCAB, max_len=100)
    n = len(rows[3][0])
    assert (
        str(err.value)
        == f"column 'seq_len': row 3 says {n + 1} but input_ids has {n} tokens (also rows 20 and 21)"
    )


def test_loss_mask_length_differs(tmp_path):
    rows = rows_with()
    bad = [17, 40, 41, 42, 50, 55]
    rows = [(ids, m[:-1]) if r in bad else (ids, m) for r, (ids, m) in enumerate(rows)]
    ids_table = {
        "input_ids": list_col([ids for ids, _ in rows]),
        "loss_mask": list_col([m for _, m in rows], pa.int8()),
    }
    ds = open_dataset(write_table(tmp_path, pa.table(ids_table)))
    with pytest.raises(DatasetError) as err:
        validate(ds, vocab_size=VOCAB, max_len=100)
    n = len(rows[17][0])
    assert str(err.value) == (
        f"column 'loss_mask': row 17 has {n - 1} values but input_ids has {n} (also rows 40, 41 and 3 more)"
    )


def test_token_id_at_vocab_size(tmp_path):
    rows = rows_with()
    rows[33][0][2] = VOCAB
    ds = open_rows(tmp_path, rows)
    with pytest.raises(
        DatasetError, match=r"^column 'input_ids': row 33 has token id 1000 outside \[0, 1000\)"
    ):
        validate(ds, vocab_size=VOCAB, max_len=100)
    assert validate(ds, vocab_size=VOCAB + 1, max_len=100).num_rows == len(rows)


def test_negative_token_id_even_without_vocab(tmp_path):
    rows = rows_with()
    rows[5][0][0] = -1
    rows[59][0][0] = -7
    ds = open_rows(tmp_path, rows)
    with pytest.raises(DatasetError, match=r"row 5 has token id -1 outside \[0, inf\) \(also row 59\)"):
        validate(ds, vocab_size=None, max_len=100)


def test_loss_mask_value_not_binary(tmp_path):
    rows = rows_with()
    rows[8][1][1] = 2
    ds = open_rows(tmp_path, rows)
    with pytest.raises(
        DatasetError, match=r"^column 'loss_mask': row 8 has value 2; loss_mask values must be 0 or 1"
    ):
        validate(ds, vocab_size=VOCAB, max_len=100)


def test_null_row(tmp_path):
    table = pa.table(
        {
            "input_ids": pa.array([[1, 2], None, [3]], pa.list_(pa.int32())),
            "loss_mask": list_col([[1, 1], [], [1]]),
        }
    )
    ds = open_dataset(write_table(tmp_path, table))
    with pytest.raises(DatasetError, match=r"^column 'input_ids': row 1 is null; drop or fill"):
        validate(ds, vocab_size=VOCAB, max_len=100)


def test_null_element(tmp_path):
    table = pa.table(
        {"input_ids": list_col([[1, 2], [3]]), "loss_mask": pa.array([[1, 1], [None]], pa.list_(pa.int8()))}
    )
    ds = open_dataset(write_table(tmp_path, table))
    with pytest.raises(DatasetError, match=r"^column 'loss_mask': row 1 holds a null element"):
        validate(ds, vocab_size=VOCAB, max_len=100)


def test_dataset_error_is_value_error_and_shard_error():
    from dflash.shards.errors import ShardError

    assert issubclass(DatasetError, ValueError) and issubclass(DatasetError, ShardError)


# --- handled cases --------------------------------------------------------------------------------


def test_skip_accounting_truncate(tmp_path):
    rows = rows_with(empty=(2, 30), unsupervised=(7,))
    # Row 11: supervised tokens only past max_len -> skipped after truncation.
    ids = np.arange(30, dtype=np.int64)
    rows[11] = (ids, (ids >= 25).astype(np.int64))
    # Row 12: long but supervised early -> kept, truncated.
    rows[12] = (ids, np.ones(30, np.int64))
    ds = open_rows(tmp_path, rows)
    report = validate(ds, vocab_size=VOCAB, max_len=20, overlong="truncate")
    lengths = np.array([len(i) for i, _ in rows])
    expected = {2: "empty", 30: "empty", 7: "no_supervised_tokens", 11: "no_supervised_tokens"}
    for r, (i, m) in enumerate(rows):  # rows whose prompt covers the first 20 tokens
        if r not in expected and len(i) and m[:20].sum() == 0:
            expected[r] = "no_supervised_tokens"
    assert report.skipped_records() == [{"row": r, "reason": expected[r]} for r in sorted(expected)]
    kept = np.array([r for r in range(len(rows)) if r not in expected])
    np.testing.assert_array_equal(report.rows, kept)
    np.testing.assert_array_equal(report.lengths, np.minimum(lengths[kept], 20))
    np.testing.assert_array_equal(report.supervised, [rows[r][1][:20].sum() for r in kept])
    assert report.truncated == int((lengths[kept] > 20).sum())
    assert report.counts == {"empty": 2, "no_supervised_tokens": len(expected) - 2, "overlong": 0}
    assert report.tokens == int(np.minimum(lengths[kept], 20).sum())
    assert report.summary()["rows"] + report.summary()["rows_skipped"] == len(rows)


def test_skip_accounting_overlong_skip(tmp_path):
    rows = rows_with(empty=(0,), unsupervised=(1,))
    ds = open_rows(tmp_path, rows)
    report = validate(ds, vocab_size=VOCAB, max_len=20, overlong="skip")
    lengths = np.array([len(i) for i, _ in rows])
    over = set(np.flatnonzero(lengths > 20).tolist()) - {0}
    reasons = dict(
        zip(report.skipped_rows.tolist(), (REASONS[c] for c in report.skipped_reasons), strict=True)
    )
    assert reasons[0] == "empty"
    assert {r for r, why in reasons.items() if why == "overlong"} == over
    assert report.truncated == 0 and report.lengths.max() <= 20
    assert report.counts["overlong"] == len(over)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=0, max_size=200),
    st.lists(st.integers(0, 12), max_size=40),
    st.data(),
)
def test_segment_sums_match_python(values, lengths, data):
    values = np.array(values, np.int8)
    total = len(values)
    starts = []
    ends = []
    for n in lengths:
        s = data.draw(st.integers(0, total))
        starts.append(s)
        ends.append(min(total, s + n))
    got = _segment_sums(values, np.array(starts, np.int64), np.array(ends, np.int64))
    assert got.tolist() == [int(values[s:e].sum()) for s, e in zip(starts, ends, strict=True)]


@settings(max_examples=15, deadline=None)
@given(
    st.integers(1, 40),
    st.integers(1, 9),
    st.integers(1, 30),
    st.sampled_from([pa.int8(), pa.bool_(), pa.int64()]),
)
def test_supervised_counts_any_chunking(tmp_path_factory, n, chunk, max_len, mask_type):
    rows = make_rows(n, seed=n * 31 + chunk, max_len=25, vocab=VOCAB)
    path = write_arrow(
        rows, tmp_path_factory.mktemp("h") / "a.arrow", rows_per_batch=chunk, mask_type=mask_type
    )
    report = validate(open_dataset(path), vocab_size=VOCAB, max_len=max_len)
    sup = {r: int(m[:max_len].sum()) for r, (_, m) in enumerate(rows)}
    assert dict(zip(report.rows.tolist(), report.supervised.tolist(), strict=True)) == {
        r: s for r, s in sup.items() if s > 0
    }


def test_huge_valid_ids_pass_without_vocab_and_negatives_fail_with_it(tmp_path):
    rows = rows_with(8)
    rows[2][0][0] = 2**31 - 1  # largest int32: fine when no vocab is given
    ds = open_dataset(write_arrow(rows, tmp_path / "a.arrow"))
    assert validate(ds, vocab_size=None, max_len=100).num_rows == 8
    rows[4][0][1] = -2
    ds = open_dataset(write_arrow(rows, tmp_path / "b.arrow"))
    with pytest.raises(
        DatasetError, match=r"row 2 has token id 2147483647 outside \[0, 1000\).*\(also row 4\)"
    ):
        validate(ds, vocab_size=VOCAB, max_len=100)
