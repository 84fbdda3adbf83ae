"""gather: right-padded batches equal the dataset rows, in numpy or torch buffers, any input form."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from dflash.extract.dataset import open_dataset
from dflash.extract.gather import GatherBuffers, gather
from dflash.extract.plan import Batch, plan_batches
from dflash.extract.validate import validate

from tests.common.datasets import make_rows, write_arrow, write_parquet, write_save_to_disk

ROWS = make_rows(150, seed=7, max_len=50, vocab=500, empty=(3,))
MAX_LEN = 40


@pytest.fixture(
    params=["save_to_disk", "arrow_bool", "parquet"],
)
def ds(request, tmp_path):
    if request.param == "save_to_disk":
        path = write_save_to_disk(ROWS, tmp_path / "d", num_files=3, rows_per_batch=11)
    elif request.param == "arrow_bool":
        path = write_arrow(ROWS, tmp_path / "a", num_files=2, rows_per_batch=9, mask_type=pa.bool_())
    else:
        path = write_parquet(ROWS, tmp_path / "p", num_files=2, row_group_size=20)
    return open_dataset(path)


def check(g, batch: Batch, pad_id: int = 0):
    ids, am, lm, lengths = (np.asarray(x) for x in (g.input_ids, g.attention_mask, g.loss_mask, g.lengths))
    assert ids.shape == am.shape == lm.shape == (batch.size, batch.padded_len)
    np.testing.assert_array_equal(lengths, batch.lengths)
    for i, r in enumerate(batch.rows.tolist()):
        n = int(batch.lengths[i])
        np.testing.assert_array_equal(ids[i, :n], ROWS[r][0][:n])
        np.testing.assert_array_equal(lm[i, :n].astype(np.int64), ROWS[r][1][:n])
        assert (ids[i, n:] == pad_id).all() and (lm[i, n:] == 0).all()
        assert (am[i, :n] == 1).all() and (am[i, n:] == 0).all()


def test_gathered_batches_equal_rows(ds):
    report = validate(ds, vocab_size=500, max_len=MAX_LEN)
    batches = plan_batches(report.rows, report.lengths, token_budget=200, pad_multiple=4)
    seen = []
    for batch in batches:
        check(gather(ds, batch), batch)
        seen.extend(batch.rows.tolist())
    assert sorted(seen) == report.rows.tolist()
    assert any(len(ROWS[r][0]) > MAX_LEN for r in seen)  # truncation exercised


def test_reused_torch_buffers_are_filled_in_place(ds):
    report = validate(ds, vocab_size=500, max_len=MAX_LEN)
    batches = plan_batches(report.rows, report.lengths, token_budget=256, pad_multiple=8)
    capacity = max(b.padded_tokens for b in batches)
    buffers = GatherBuffers(
        input_ids=torch.empty(capacity, dtype=torch.int64),
        attention_mask=torch.empty(capacity, dtype=torch.int64),
        loss_mask=torch.empty(capacity, dtype=torch.bool),
        lengths=torch.empty(max(b.size for b in batches), dtype=torch.int64),
    )
    for batch in batches[::-1]:  # shortest first: stale longer data must not leak
        g = gather(ds, batch, buffers, pad_id=7)
        assert (
            isinstance(g.input_ids, torch.Tensor) and g.input_ids.data_ptr() == buffers.input_ids.data_ptr()
        )
        check(g, batch, pad_id=7)


def test_numpy_buffers_and_arbitrary_row_order(ds):
    rows = np.array([149, 0, 77, 1, 148], np.int64)
    lengths = np.minimum(ds.list_lengths[rows], MAX_LEN)
    batch = Batch(rows=rows, lengths=lengths, padded_len=int(lengths.max()))
    buffers = GatherBuffers.numpy(batch.padded_tokens + 10, 8)
    g = gather(ds, batch, buffers, pad_id=-1)
    assert np.shares_memory(g.input_ids, buffers.input_ids)
    check(g, batch, pad_id=-1)


def test_too_small_buffer_is_refused(ds):
    batch = Batch(rows=np.array([0, 1]), lengths=np.array([5, 5]), padded_len=5)
    buffers = GatherBuffers.numpy(9, 2)
    with pytest.raises(ValueError, match=r"input_ids buffer must be C-contiguous with >= 10 elements"):
        gather(ds, batch, buffers)


def test_compact_buffers_hold_int32_ids_and_no_attention_mask(ds):
    report = validate(ds, vocab_size=500, max_len=MAX_LEN)
    batches = plan_batches(report.rows, report.lengths, token_budget=256, pad_multiple=8)
    buffers = GatherBuffers.compact(max(b.padded_tokens for b in batches), max(b.size for b in batches))
    for batch in batches[::-1]:  # shortest first: stale longer data in the padding tails must not leak
        g = gather(ds, batch, buffers, pad_id=3)
        assert g.attention_mask is None and g.input_ids.dtype == torch.int32
        ids, lm = g.input_ids.numpy(), g.loss_mask.numpy()
        for i, r in enumerate(batch.rows.tolist()):
            n = int(batch.lengths[i])
            np.testing.assert_array_equal(ids[i, :n], ROWS[r][0][:n])
            np.testing.assert_array_equal(lm[i, :n], ROWS[r][1][:n])
            assert (ids[i, n:] == 3).all() and (lm[i, n:] == 0).all()
        np.testing.assert_array_equal(g.lengths.numpy(), batch.lengths)


def test_token_positions_match_the_padded_mask():
    from dflash.extract.stages import _token_positions

    lengths = np.array([5, 0, 3, 8], np.int64)
    mask = np.arange(8)[None, :] < lengths[:, None]
    np.testing.assert_array_equal(_token_positions(lengths, 8), np.flatnonzero(mask))
