"""The loader's worker processes: the thread loader's batches exactly, errors in one line, nothing left behind."""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dflash.shards import Cache, ShardReader
from dflash.shards.errors import ShardError
from dflash.train import batch_wire
from dflash.train.data_spec import DataSpec
from dflash.train.loader import StreamingLoader
from dflash.train.loader_procs import ProcessLoader, slot_dir, streaming_loader
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.common.fake_cache import corrupt_sample, write_fake_cache

SPEC = dict(
    layer_ids=[1, 3], block_size=4, mask_token_id=90, num_anchors=4, gamma=2.0, token_budget=96, max_length=40,
    shuffle_window=8, loader_threads=2, prefetch_batches=3, heldout_fraction=0.2, seed=1, epochs=2,
)  # fmt: skip


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return write_fake_cache(tmp_path_factory.mktemp("cache"), num_samples=48, samples_per_shard=10)


def _loader(cache: Path, workers: int, **overrides) -> StreamingLoader:
    spec = DataSpec(**{**SPEC, "loader_workers": workers, **overrides})
    return streaming_loader(Cache.open(cache), spec)


def _collect(loader: StreamingLoader, limit: int | None = None) -> list:
    out = []
    stream = loader.iterate()
    for item in stream:
        out.append(item)
        if len(out) == limit:
            stream.close()
            break
    loader.cache.close()
    return out


def _slot_files() -> list[Path]:
    return sorted(slot_dir().glob(f"dflash-loader-{os.getpid()}-*"))


def _same(a: list, b: list) -> None:
    assert len(a) == len(b) > 2
    for (x, sx), (y, sy) in zip(a, b, strict=True):
        assert (x.scalars(), sx) == (y.scalars(), sy)  # rows, epoch, index, weights, skips; the position
        for s, t in zip(x.batch.tensors(), y.batch.tensors(), strict=True):
            assert s.dtype == t.dtype and torch.equal(s, t)


@pytest.mark.parametrize("workers", [1, 3])
def test_worker_processes_give_the_thread_loaders_batches_and_leave_no_files(
    cache_dir: Path, workers: int
) -> None:
    loader = _loader(cache_dir, workers)
    assert isinstance(loader, ProcessLoader)
    _same(_collect(_loader(cache_dir, 0)), _collect(loader))
    assert _slot_files() == []


def test_a_worker_done_with_its_jobs_keeps_its_slots_until_the_parent_has_read_them(cache_dir: Path) -> None:
    """Every batch in a slot the parent has not mapped yet (more slots than jobs), and a slow consumer: the
    workers finish their share long before the parent opens their last slots."""
    loader = _loader(cache_dir, 2, prefetch_batches=40, epochs=1)
    stream = loader.iterate()
    first = next(stream)
    time.sleep(2.0)  # every worker has written all of its batches and said so
    items = [first, *stream]
    loader.cache.close()
    _same(_collect(_loader(cache_dir, 0, epochs=1)), items)
    assert loader.worker_exit_codes == [0, 0] and _slot_files() == []


def test_undecoded_fp8_batches_and_a_resume_match_too(tmp_path: Path) -> None:
    cache = write_fake_cache(tmp_path / "fp8", num_samples=30, samples_per_shard=8, codec="fp8", max_len=50)
    threads = _collect(_loader(cache, 0, dequantize_on_device=True))
    _same(threads, _collect(_loader(cache, 2, dequantize_on_device=True)))
    resumed = _loader(cache, 2, dequantize_on_device=True)
    resumed.load_state_dict(threads[4][1])
    _same(threads[5:], _collect(resumed))


def test_a_corrupt_sample_is_skipped_and_counted_or_stops_the_run_in_one_line(tmp_path: Path) -> None:
    cache = write_fake_cache(tmp_path / "c", num_samples=30, samples_per_shard=10)
    reader = ShardReader.open(cache / "shards" / "shard-000001.dfs")
    rows = {e.row for e in reader.entries}
    reader.close()
    threads = _collect(_loader(cache, 0, layer_ids=[1], heldout_fraction=0.0, epochs=1))
    bad_row = corrupt_sample(cache, "shard-000001.dfs", 2, frame=3)
    assert bad_row in rows
    loader = _loader(cache, 2, layer_ids=[1], on_corrupt="skip", heldout_fraction=0.0, epochs=1)
    items = _collect(loader)
    seen = [r for b, _ in items for r in b.rows]
    assert sorted(seen) == sorted(r for b, _ in threads for r in b.rows if r != bad_row)
    assert items[-1][1]["skipped_samples"] == 1 and "checksum" in loader.corrupt_messages[0]
    failing = _loader(cache, 2, layer_ids=[1], heldout_fraction=0.0, epochs=1)
    with pytest.raises(ShardError, match=r"checksum mismatch.*--on-corrupt skip") as exc:
        _collect(failing)
    assert "\n" not in str(exc.value)
    assert sorted(failing.worker_exit_codes) == [0, 1]  # the failed worker's own exit status, not a kill
    assert _slot_files() == []


def test_a_killed_worker_stops_the_run_naming_it(cache_dir: Path) -> None:
    loader = _loader(cache_dir, 2)
    stream = loader.iterate()
    next(stream)
    os.kill(loader.worker_pids[1], signal.SIGKILL)
    with pytest.raises(ChildProcessError, match=r"loader worker 1 \(pid \d+\) exited with code -9"):
        for _ in stream:
            pass
    loader.cache.close()
    assert _slot_files() == []


def test_closing_the_stream_early_ends_the_workers(cache_dir: Path) -> None:
    loader = _loader(cache_dir, 2)
    assert len(_collect(loader, limit=2)) == 2
    assert loader.worker_exit_codes == [0, 0]  # each ended at the closed pipe, none had to be killed
    for pid in loader.worker_pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reaped: not a zombie, not running
    assert _slot_files() == []


def test_warm_workers_serve_the_next_iterate_from_its_position_or_are_closed(cache_dir: Path) -> None:
    full = _collect(_loader(cache_dir, 0))
    loader = _loader(cache_dir, 2)
    loader.warm_up()  # started before the position is known (a resume loads it after)
    warm = list(loader._spare)
    loader.load_state_dict(full[3][1])
    _same(full[4:], _collect(loader))
    assert [w.proc.pid for w in warm] == loader.worker_pids and loader.worker_exit_codes == [0, 0]
    unused = _loader(cache_dir, 2)
    unused.warm_up()
    procs = [w.proc for w in unused._spare]
    unused.close()
    unused.cache.close()
    assert [p.returncode for p in procs] == [0, 0] and _slot_files() == []


def test_cuda_runs_default_to_four_workers_and_cpu_runs_to_threads(cache_dir: Path) -> None:
    spec = DataSpec(**{**SPEC, "loader_workers": None})
    with Cache.open(cache_dir) as cache:
        on_gpu = streaming_loader(cache, spec, device=torch.device("cuda", 0))  # built, never iterated
        assert isinstance(on_gpu, ProcessLoader) and on_gpu.spec.loader_workers == 4
        on_cpu = streaming_loader(cache, spec, device=torch.device("cpu"))
        assert type(on_cpu) is StreamingLoader and on_cpu.spec.loader_workers == 0


def test_wire_round_trip_keeps_a_tiled_batch_and_refuses_unknown_names(cache_dir: Path) -> None:
    batch = _collect(_loader(cache_dir, 0), limit=1)[0][0].batch.with_tile_layout(tile=(8, 8))
    tree, tensors = batch_wire.flatten(batch)
    layout, size = batch_wire.place(tensors)
    buffer = bytearray(size)
    batch_wire.write_tensors(buffer, tensors, layout)
    back = batch_wire.unflatten(tree, batch_wire.read_tensors(buffer, layout))
    assert back.tile_layout.tile == (8, 8) and back.tile_layout.num_queries == batch.tile_layout.num_queries
    for s, t in zip(batch.tensors(), back.tensors(), strict=True):
        assert s.dtype == t.dtype and torch.equal(s, t)
    with pytest.raises(ValueError, match="unknown type 'os'"):
        batch_wire.unflatten({"type": "os", "fields": {}}, [])
    with pytest.raises(ValueError, match="unknown dtype 'object'"):
        batch_wire.read_tensors(buffer, [{"dtype": "object", "shape": [1], "offset": 0}])


_WIRE_DTYPES = [torch.uint8, torch.int8, torch.int32, torch.int64, torch.bool, torch.bfloat16, torch.float32]


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1))  # unit stride, whatever t's strides
    return flat if t.dtype == torch.bool else flat.view(torch.uint8)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(_WIRE_DTYPES),
            st.lists(st.integers(0, 5), max_size=3),
            st.integers(0, 2**31),
            st.booleans(),
        ),
        max_size=6,
    ),
    st.one_of(st.none(), st.integers(-(2**40), 2**40), st.booleans(), st.text(max_size=8)),
)
@example(specs=[(torch.int32, [1], 0, True)], scalar=None)  # one tile's layout on an H200 was such a view
def test_wire_round_trips_any_tensors_and_scalars(specs, scalar) -> None:
    tensors = []
    for dtype, shape, seed, strided in specs:
        g = torch.Generator().manual_seed(seed)
        # strided: every other element of a wider tensor, so the last stride is 2 (a size-1 last axis keeps
        # that stride and still counts as contiguous: tile layouts of one tile are such views)
        wide = [*shape[:-1], 2 * shape[-1]] if strided and shape else shape
        t = torch.randint(0, 256, (*wide, dtype.itemsize), dtype=torch.uint8, generator=g)
        t = t.view(dtype).reshape(wide) if dtype != torch.bool else (t[..., 0] % 2).bool()
        tensors.append(t[..., ::2] if strided and shape else t)
    value = (tuple(tensors), scalar)
    tree, flat = batch_wire.flatten(value)
    layout, size = batch_wire.place(flat)
    assert all(e["offset"] % batch_wire.ALIGN == 0 for e in layout)
    buffer = bytearray(size)
    batch_wire.write_tensors(buffer, flat, layout)
    back_tensors, back_scalar = batch_wire.unflatten(tree, batch_wire.read_tensors(buffer, layout))
    assert back_scalar == scalar and len(back_tensors) == len(tensors)
    for a, b in zip(tensors, back_tensors, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_bits(a), _bits(b))  # bitwise: NaN payloads of random floats included
    if size:  # a slot shorter than the layout says is refused, never read past
        with pytest.raises(ValueError):
            batch_wire.read_tensors(bytearray(size - batch_wire.ALIGN), layout)


_PARENT = """
import sys, time
from dflash.shards import Cache
from dflash.train.data_spec import DataSpec
from dflash.train.loader_procs import ProcessLoader
spec = DataSpec(layer_ids=[1, 3], block_size=4, mask_token_id=90, num_anchors=4, gamma=2.0, token_budget=96,
                max_length=40, loader_workers=2, epochs=50)
loader = ProcessLoader(Cache.open(sys.argv[1]), spec)
stream = loader.iterate()
next(stream)
print(*loader.worker_pids, flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"  # exited, waiting for a reaper that is not the killed parent


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_workers_of_a_killed_trainer_exit_and_remove_their_slots(cache_dir: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(cache_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and not any(_gone(p) for p in pids)
        files = list(slot_dir().glob(f"dflash-loader-{parent.pid}-*"))
        assert files  # the workers' slots exist while they run
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(_gone(p) for p in pids):
            time.sleep(0.1)
        assert all(_gone(p) for p in pids)  # each saw its control pipe close
        assert not any(f.exists() for f in files)
    finally:
        parent.kill()


def test_a_worker_that_cannot_start_stops_dflash_train_in_one_line(
    cache_dir: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    from dflash.train import cli as train_cli
    from dflash.train import loader_procs

    from tests.common.train_cli import tiny_train_argv

    monkeypatch.setattr(
        loader_procs, "slot_dir", lambda: tmp_path / "no-such-dir"
    )  # its slots cannot be made
    argv = tiny_train_argv(cache_dir, tmp_path / "run", "--loader-workers", "2", "--max-steps", "3")
    assert train_cli.main([*argv, "--target-layer-ids", "1,3", "--num-draft-layers", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(
        r"dflash-train: error: loader worker 0 failed: FileNotFoundError: .*no-such-dir.*", err
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_workers_deliver_the_thread_loaders_device_batches_tiles_included(tmp_path: Path) -> None:
    cache = write_fake_cache(tmp_path / "fp8", num_samples=30, samples_per_shard=8, codec="fp8", max_len=50)
    device = torch.device("cuda", torch.cuda.current_device())

    def on_device(workers: int) -> list:
        loader = streaming_loader(
            Cache.open(cache),
            DataSpec(**{**SPEC, "loader_workers": workers, "attention": "flex"}),
            device=device,
        )  # "flex": batches this small are dense SDPA's under "auto", and get no tiles
        items = [(loaded, state) for loaded, state in loader.iterate()]
        for loaded, _ in items:
            loaded.wait()
        loader.cache.close()
        return items

    threads, procs = on_device(0), on_device(2)
    assert all(b.batch.features.is_cuda and b.batch.tile_layout is not None for b, _ in procs)
    _same(threads, procs)


def test_a_full_shared_memory_is_an_error_naming_the_fix_not_a_crash(tmp_path: Path, monkeypatch) -> None:
    from dflash.train import loader_worker

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(loader_worker.os, "posix_fallocate", full, raising=False)
    slots = loader_worker.Slots([str(tmp_path / "slot0")])
    with pytest.raises(OSError, match=r"no room for a 1 MiB batch slot in .*--shm-size.*--loader-workers 0"):
        slots.buffer(0, 1000)
    slots.remove()
    assert list(tmp_path.iterdir()) == []


def test_worker_errors_keep_data_errors_as_such_and_name_the_worker_otherwise() -> None:
    from dflash.shards.errors import CorruptFrame, ManifestMismatch
    from dflash.train.loader_procs import worker_error

    assert type(worker_error(0, "CorruptFrame", "bad frame")) is CorruptFrame
    mismatch = worker_error(1, "ManifestMismatch", "cache: codec differs")
    assert type(mismatch) is ShardError and not isinstance(mismatch, ManifestMismatch)
    assert str(mismatch) == "cache: codec differs"
    assert type(worker_error(0, "ValueError", "no")) is ValueError
    other = worker_error(2, "KeyError", "'x'")
    assert isinstance(other, ChildProcessError) and str(other) == "loader worker 2 failed: KeyError: 'x'"
