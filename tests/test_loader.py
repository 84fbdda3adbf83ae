"""The streaming loader over a real (tiny) cache: coverage, hold-out, resume, corruption, ranks, latency."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from dflash.shards import Cache, ShardReader, get_codec
from dflash.shards.errors import ShardError
from dflash.train.config import tiny_debug
from dflash.train.data_plan import heldout_mask
from dflash.train.data_spec import DataSpec
from dflash.train.loader import StreamingLoader
from dflash.train.loop import train

from tests.common.fake_cache import corrupt_sample, write_fake_cache

FRACTION = 0.2


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return write_fake_cache(tmp_path_factory.mktemp("cache"), num_samples=48, samples_per_shard=10)


def _loader(cache_dir: Path, **overrides) -> StreamingLoader:
    kwargs = dict(
        layer_ids=[1, 3],
        block_size=4,
        mask_token_id=90,
        num_anchors=4,
        gamma=2.0,
        token_budget=96,
        max_length=40,
        shuffle_window=8,
        loader_threads=2,
        prefetch_batches=3,
        on_corrupt="fail",
        heldout_fraction=FRACTION,
        seed=1,
        epochs=2,
    )
    kwargs.update(overrides)
    path = kwargs.pop("cache", cache_dir)
    place = {k: kwargs.pop(k) for k in ("rank", "world_size", "device") if k in kwargs}
    spec = DataSpec(**kwargs)  # checked before the cache is opened
    return StreamingLoader(Cache.open(path), spec, **place)


def _train_rows(n: int) -> set[int]:
    rows = np.arange(n)
    return set(rows[~heldout_mask(rows, FRACTION)].tolist())


def _collect(loader: StreamingLoader, limit: int | None = None) -> list:
    out = []
    gen = loader.iterate()
    for item in gen:
        out.append(item)
        if limit is not None and len(out) == limit:
            gen.close()
            break
    return out


def test_each_epoch_sees_every_training_row_once(cache_dir: Path) -> None:
    items = _collect(_loader(cache_dir))
    for epoch in (0, 1):
        rows = Counter(r for b, _ in items if b.epoch == epoch for r in b.rows)
        assert set(rows) == _train_rows(48) and set(rows.values()) == {1}  # held-out rows never appear
    first = [r for b, _ in items if b.epoch == 0 for r in b.rows]
    second = [r for b, _ in items if b.epoch == 1 for r in b.rows]
    assert first != second  # reshuffled per epoch
    batch = items[0][0].batch
    assert batch.features.shape[1] == 2 * 32 and batch.features.dtype == torch.bfloat16  # 2 of the 4 layers
    assert all(b.tokens <= 96 and b.loss_scale == 1.0 for b, _ in items)


def test_resume_from_any_state_gives_the_same_batches(cache_dir: Path) -> None:
    full = _collect(_loader(cache_dir))
    for cut in (1, 4, len(full) // 2 + 1):
        loader = _loader(cache_dir)
        loader.load_state_dict(full[cut - 1][1])
        rest = _collect(loader)
        assert len(rest) == len(full) - cut
        for (a, _), (b, _) in zip(rest, full[cut:], strict=True):
            assert a.rows == b.rows and (a.epoch, a.index) == (b.epoch, b.index)
            assert torch.equal(a.batch.block_ids, b.batch.block_ids)  # same anchors too
            assert torch.equal(a.batch.features, b.batch.features)


def test_the_shard_order_of_runs_started_before_spans_resumes_exactly(cache_dir: Path) -> None:
    full = _collect(_loader(cache_dir, order="shards"))
    resumed = _loader(cache_dir, order="shards")
    resumed.load_state_dict(full[2][1])
    assert [b.rows for b, _ in _collect(resumed)] == [b.rows for b, _ in full[3:]]
    assert [b.rows for b, _ in full] != [b.rows for b, _ in _collect(_loader(cache_dir))]  # spans differ


def test_a_checkpoint_from_before_spans_resumes_with_the_flag_it_names(
    cache_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    common = {"eval_every": 0, "tensorboard": False, "plots": False}
    train(tiny_debug(str(cache_dir), str(run), max_steps=2, data_order="shards", **common))
    meta_path = run / "checkpoints" / "step_000002" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["config"]["data_order"]  # written before the setting existed: the shard order trained it
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(
        ValueError, match=r"data_order: 'shards' \(checkpoint\) != 'spans'.*add --data-order shards"
    ):
        train(tiny_debug(str(cache_dir), str(run), max_steps=3, resume=True, **common))
    resumed = train(
        tiny_debug(str(cache_dir), str(run), max_steps=3, resume=True, data_order="shards", **common)
    )
    assert resumed.step == 3


def test_caches_cut_into_other_shards_give_the_same_batches(cache_dir: Path, tmp_path: Path) -> None:
    """The same samples in shards of 10 and of 7 (as lossless and fp8 caches cut one stored order): one run."""
    other = write_fake_cache(tmp_path / "c7", num_samples=48, samples_per_shard=7)
    a, b = _collect(_loader(cache_dir)), _collect(_loader(other))
    assert [(x.rows, x.epoch) for x, _ in a] == [(y.rows, y.epoch) for y, _ in b]
    assert all(torch.equal(x.batch.block_ids, y.batch.block_ids) for (x, _), (y, _) in zip(a, b, strict=True))


def test_two_ranks_split_each_epoch(cache_dir: Path) -> None:
    per_rank = [_collect(_loader(cache_dir, rank=r, world_size=2)) for r in (0, 1)]
    assert len(per_rank[0]) == len(per_rank[1])  # same number of steps on both ranks
    for epoch in (0, 1):
        seen = Counter(r for items in per_rank for b, _ in items if b.epoch == epoch for r in b.rows)
        assert set(seen) == _train_rows(48) and set(seen.values()) == {1}


def test_missing_layer_is_refused_in_one_line(cache_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"layers \[7\] missing, the cache holds \[0, 1, 2, 3\]") as exc:
        _loader(cache_dir, layer_ids=[1, 7])
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("epochs", [None, 0, True])
def test_a_spec_without_a_whole_number_of_epochs_is_refused(cache_dir: Path, epochs) -> None:
    """A left-out --epochs is pinned before the loader is made (`run_parts.settle_epochs`); one that is not
    would otherwise end the loader at its first `range()`, mid-run."""
    with pytest.raises(ValueError, match=rf"epochs={epochs!r}: must be a whole number >= 1"):
        _loader(cache_dir, epochs=epochs)


def test_corrupt_sample_skip_and_fail(tmp_path: Path) -> None:
    cache = write_fake_cache(tmp_path / "c", num_samples=30, samples_per_shard=10)
    reader = ShardReader.open(cache / "shards" / "shard-000001.dfs")
    index = next(i for i, e in enumerate(reader.entries) if e.row in _train_rows(30))
    reader.close()
    bad_row = corrupt_sample(cache, "shard-000001.dfs", index, frame=3)
    items = _collect(_loader(cache, layer_ids=[1], on_corrupt="skip", epochs=1))
    rows = [r for b, _ in items for r in b.rows]
    assert bad_row not in rows and set(rows) == _train_rows(30) - {bad_row}
    assert items[-1][1]["skipped_samples"] == 1
    # A layer the run does not read is never decoded, so its corruption cannot hurt:
    ok = _collect(_loader(cache, layer_ids=[0], on_corrupt="fail", epochs=1))
    assert bad_row in [r for b, _ in ok for r in b.rows]
    with pytest.raises(ShardError, match=r"checksum mismatch.*--on-corrupt skip"):
        _collect(_loader(cache, layer_ids=[1], on_corrupt="fail", epochs=1))


def test_corrupt_shard_index(tmp_path: Path) -> None:
    cache = write_fake_cache(tmp_path / "c", num_samples=30, samples_per_shard=10)
    path = cache / "shards" / "shard-000002.dfs"
    data = bytearray(path.read_bytes())
    data[-40] ^= 0xFF  # inside the index
    path.write_bytes(bytes(data))
    loader = _loader(cache, on_corrupt="skip", epochs=1)
    rows = {r for b, _ in _collect(loader) for r in b.rows}
    assert rows == _train_rows(30) - set(range(20, 30))
    assert list(loader.bad_shards) == ["shard-000002.dfs"]
    with pytest.raises(ShardError, match="index"):
        _collect(_loader(cache, on_corrupt="fail", epochs=1))


def test_first_batch_comes_fast_on_a_big_cache(tmp_path: Path, monkeypatch) -> None:
    cache = write_fake_cache(tmp_path / "big", num_samples=6000, samples_per_shard=100, min_len=6, max_len=10)
    opened: list[str] = []
    real_open = ShardReader.open.__func__

    def counting_open(cls, path, *args):
        opened.append(Path(path).name)
        return real_open(cls, path, *args)

    monkeypatch.setattr(ShardReader, "open", classmethod(counting_open))
    start = time.perf_counter()
    loader = _loader(cache, shuffle_window=64, token_budget=64)
    first = _collect(loader, limit=1)
    elapsed = time.perf_counter() - start
    assert first and elapsed < 5.0
    # of 60 shards: nothing scans the cache before the first batch; the window's and the read-ahead's spans
    # (64 samples each, across two shards at most) open a handful
    assert len(set(opened)) <= 6


def test_explicit_eval_rows_never_reach_training(cache_dir: Path) -> None:
    held = frozenset({0, 5, 17, 33})
    items = _collect(_loader(cache_dir, heldout_fraction=0.0, heldout_rows=held, epochs=1))
    rows = [r for b, _ in items for r in b.rows]
    assert sorted(rows) == sorted(set(range(48)) - held)


@pytest.mark.parametrize("codec", ["fp8", "q4"])
def test_undecoded_batches_decoded_after_the_copy_equal_the_cpu_decode(tmp_path: Path, codec: str) -> None:
    """fp8/q4 read undecoded, packed as codes + scales and decoded "on the device" gives the same bf16 bits
    as the codec's CPU decode, batch for batch (max_length truncates some samples: block slicing)."""
    cache = write_fake_cache(tmp_path / codec, num_samples=24, samples_per_shard=8, codec=codec, max_len=50)
    on_host = _collect(_loader(cache, dequantize_on_device=False, epochs=1))
    on_device = _collect(_loader(cache, dequantize_on_device=True, epochs=1))
    assert len(on_host) == len(on_device) > 1
    for (a, _), (b, _) in zip(on_host, on_device, strict=True):
        assert a.rows == b.rows and b.batch.feature_scales is None
        assert b.batch.features.dtype == torch.bfloat16
        assert torch.equal(a.batch.features.view(torch.int16), b.batch.features.view(torch.int16))
    loader = _loader(cache, dequantize_on_device=True)
    assert loader.decode_on_device
    filler = loader._filler()
    block = get_codec(codec).decode_block(get_codec(codec).encode(torch.zeros(2, 1)), (2, 1))
    assert all(type(f) is type(block) for f in filler.hidden.values())


def test_wait_records_every_tensor_on_the_consumer_stream(cache_dir: Path, monkeypatch) -> None:
    """The CUDA branch of `LoadedBatch.wait`, driven on the CPU with a fake stream: every tensor of the
    batch is recorded on the consumer's stream, and optional fields left as None are skipped."""
    loaded = _collect(_loader(cache_dir), limit=1)[0][0]
    assert loaded.batch.feature_scales is None
    events, recorded = [], []

    class FakeStream:
        def wait_event(self, event: object) -> None:
            events.append(event)

    stream = FakeStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: recorded.append((self, s)))
    loaded.ready = "copy-done"
    batch = loaded.wait()
    assert events == ["copy-done"] and loaded.ready is None
    assert len(recorded) == len(batch.tensors()) == 8 and all(s is stream for _, s in recorded)


def test_closing_the_stream_joins_every_thread_before_the_cache_closes(cache_dir: Path) -> None:
    loader = _loader(cache_dir)
    stream = loader.iterate()
    next(stream)  # the planner and the pools are busy prefetching
    stream.close()
    alive = [t.name for t in threading.enumerate() if t.name.startswith("dflash-")]
    loader.cache.close()
    assert alive == []


def test_loader_threads_run_torch_on_one_thread_and_the_consumer_keeps_its_own(
    cache_dir: Path, monkeypatch
) -> None:
    """Each loader thread's torch ops stay on that thread (an OpenMP team per loader thread oversubscribed a
    16-core box ~16x), while the training thread keeps the count it had."""
    seen: dict[str, int] = {}
    loader = _loader(cache_dir)
    read, build = loader.read, loader._build

    def spy(fn):
        def wrapped(*args, **kwargs):
            seen[threading.current_thread().name.rsplit("_", 1)[0]] = torch.get_num_threads()
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(loader, "read", spy(read))
    monkeypatch.setattr(loader, "_build", spy(build))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _collect(loader, limit=3)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen == {"dflash-decode": 1, "dflash-build": 1}
