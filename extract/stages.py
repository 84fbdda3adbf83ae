"""The extraction pipeline's stages, joined by bounded queues; the GPU stage should never wait.

    loader thread   gather a batch's rows into (pinned) host tensors                 -> q_in
    main thread     H2D on a copy stream, forward, keep real tokens, flag non-finite
                    tokens, quantize (fp8, q4, q6) on the GPU, D2H into pinned buffers
                    on the copy stream (with an event)                               -> q_out
    drain thread    wait for the D2H event, apply --on-nonfinite, submit one encode
                    task per kept sample                                             -> q_write
    encode pool     encode_sample (zstd releases the GIL)
    writer thread   one ShardWriter per work unit, samples in plan order; a Committer publishes each
                    finished shard (fsync, rename) on its own threads while the next one streams

Every thread that fails sets the shared stop event; queue operations give up when it is set, so an
error anywhere (ENOSPC in the writer, a bad row in the loader) stops the run promptly and the first
error is re-raised in the caller. On CPU the same code runs without streams or events.

NaN/inf hidden states are flagged by the GPU stage and handled by the drain (`nonfinite.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from dflash.shards.codecs import Codec
from dflash.shards.manifest import ShardInfo
from dflash.shards.writer import COMMITS_IN_FLIGHT, Committer, EncodedSample, ShardWriter, encode_sample

from .gather import GatherBuffers, gather
from .nonfinite import NonFiniteStates, nonfinite_flags, nonfinite_reasons

_POLL = 0.1  # seconds between checks of the stop event while blocked on a queue


class Stopped(Exception):
    """Raised inside a stage when another stage failed and the run is stopping."""


@dataclass(slots=True)
class StageClock:
    """Seconds a stage spent working, waiting for input, and blocked on a full output queue."""

    name: str
    busy: float = 0.0
    wait_in: float = 0.0
    wait_out: float = 0.0

    @contextlib.contextmanager
    def timing(self, what: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, what, getattr(self, what) + time.perf_counter() - t)

    def to_dict(self) -> dict[str, float]:
        total = self.busy + self.wait_in + self.wait_out
        waiting = self.wait_in + self.wait_out
        return {
            "busy_s": self.busy,
            "wait_in_s": self.wait_in,
            "wait_out_s": self.wait_out,
            "wait_fraction": waiting / total if total else 0.0,
        }


class Channel:
    """A bounded queue whose put/get give up (raise Stopped) once the run's stop event is set."""

    def __init__(self, depth: int, stop: threading.Event):
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = stop

    def put(self, item: Any) -> None:
        while True:
            if self._stop.is_set():
                raise Stopped
            try:
                self._q.put(item, timeout=_POLL)
                return
            except queue.Full:
                continue

    def get(self) -> Any:
        while True:
            if self._stop.is_set():
                raise Stopped
            try:
                return self._q.get(timeout=_POLL)
            except queue.Empty:
                continue


@dataclass(slots=True)
class WorkBatch:
    """One planned batch on its way through the stages."""

    unit: int
    first_in_unit: bool
    last_in_unit: bool
    rows: np.ndarray  # int64 [B]
    lengths: np.ndarray  # int64 [B]
    input_ids: torch.Tensor  # int32 [B, T] host; widened to int64 on the device
    loss_mask: torch.Tensor  # [B, T] host
    select: torch.Tensor  # int64 [N] flat indexes of the real tokens in [B*T]
    # Filled by the GPU stage:
    features: tuple[torch.Tensor, ...] = ()  # host: the codec's `quantize_batch` output, e.g. ([K, N, H],)
    nonfinite: torch.Tensor | None = None  # host bool [K, N]: token n of layer k holds a NaN/inf
    ready: Any = None  # CUDA event after the D2H copy, None on CPU
    timing: tuple[Any, Any] | None = None  # CUDA events around the compute
    host_ms: float = 0.0  # the main thread's time in GpuStep for this batch (launches, host copies)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())


@dataclass(slots=True)
class StageStats:
    clocks: dict[str, StageClock] = field(default_factory=dict)
    gpu_compute_s: float = 0.0  # measured on the GPU with events (CUDA) or the host clock (CPU)
    gpu_span_s: float = 0.0  # first compute start to last compute end
    # Per batch, in the order the drain saw them: (real tokens, GPU compute ms, main-thread ms to enqueue it).
    # Benchmarks compare these with the bare forward batch by batch; a run's summary uses the totals.
    batch_times: list[tuple[int, float, float]] = field(default_factory=list)
    encode_cpu_s: float = 0.0  # summed over pool threads
    rows: int = 0
    tokens: int = 0
    rows_nonfinite: int = 0  # rows skipped by --on-nonfinite skip
    raw_bytes: int = 0
    bytes_written: int = 0
    shards: list[ShardInfo] = field(default_factory=list)

    def clock(self, name: str) -> StageClock:
        return self.clocks.setdefault(name, StageClock(name))

    @property
    def gpu_wait_fraction(self) -> float:
        return max(0.0, 1.0 - self.gpu_compute_s / self.gpu_span_s) if self.gpu_span_s > 0 else 0.0


def load_batches(
    ds: Any, units: list[tuple[int, list[Any]]], out: Channel, clock: StageClock, device: torch.device
) -> None:
    """Loader thread: gather each planned batch into fresh (pinned when CUDA) host tensors."""
    pin = device.type == "cuda"
    if pin:
        # Pinned allocations use the thread's current device: without this every rank's loader
        # would create a context on cuda:0.
        torch.cuda.set_device(device)
    for unit, batches in units:
        for j, batch in enumerate(batches):
            with clock.timing("busy"):
                # int32 ids and no attention mask: half the host bytes to write and copy; GpuStep widens
                # the ids after the H2D copy, and right-padded rows need no mask (extract.target).
                buffers = GatherBuffers.compact(batch.padded_tokens, batch.size, pin_memory=pin)
                g = gather(ds, batch, buffers)
                select = torch.from_numpy(_token_positions(np.asarray(batch.lengths), batch.padded_len))
                item = WorkBatch(
                    unit=unit,
                    first_in_unit=j == 0,
                    last_in_unit=j == len(batches) - 1,
                    rows=np.asarray(batch.rows),
                    lengths=np.asarray(batch.lengths),
                    input_ids=g.input_ids,
                    loss_mask=g.loss_mask,
                    select=select.pin_memory() if pin else select,
                )
            with clock.timing("wait_out"):
                out.put(item)
    out.put(None)


def _token_positions(lengths: np.ndarray, padded_len: int) -> np.ndarray:
    """Flat indexes in [B * padded_len] of each row's first lengths[i] positions (row-major), int64."""
    total = int(lengths.sum())
    packed_starts = np.cumsum(lengths) - lengths
    row_starts = np.arange(lengths.size, dtype=np.int64) * padded_len
    return np.arange(total, dtype=np.int64) + np.repeat(row_starts - packed_starts, lengths)


class GpuStep:
    """Forward + token selection + the codec's quantization + D2H for one batch (the main thread's work)."""

    def __init__(self, target: Any, codec: Codec):
        self.target = target
        self.codec = codec
        self.device = target.device
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.compute_stream = torch.cuda.current_stream(self.device) if self.cuda else None

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        d = t.to(self.device, non_blocking=True)
        if self.cuda:
            d.record_stream(self.compute_stream)  # used there; keep the copy stream's block alive
        return d

    def __call__(self, item: WorkBatch) -> WorkBatch:
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                ids, select = (self._to_device(t) for t in (item.input_ids, item.select))
            self.compute_stream.wait_stream(self.copy_stream)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.compute_stream)
        else:
            ids, select = item.input_ids, item.select
        features, nonfinite = self._compute(ids, select, item.lengths)
        if not self.cuda:
            item.features, item.nonfinite = features, nonfinite
            return item
        end.record(self.compute_stream)
        item.timing = (start, end)
        self.copy_stream.wait_stream(self.compute_stream)
        with torch.cuda.stream(self.copy_stream):
            host = []
            for t in (*features, nonfinite):
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                t.record_stream(self.copy_stream)  # the allocator must not reuse it before the copy ends
                host.append(h)
            item.ready = torch.cuda.Event()
            item.ready.record(self.copy_stream)
        item.features, item.nonfinite = tuple(host[:-1]), host[-1]
        return item

    @torch.inference_mode()
    def _compute(
        self, ids: torch.Tensor, select: torch.Tensor, lengths: np.ndarray
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        outs = self.target.capture(ids.long())
        b, s, h = outs[0].shape
        packed = torch.empty((len(outs), select.numel(), h), dtype=outs[0].dtype, device=outs[0].device)
        for k, o in enumerate(outs):
            torch.index_select(o.reshape(b * s, h), 0, select, out=packed[k])
        del outs
        return self.codec.quantize_batch(packed, lengths.tolist()), nonfinite_flags(packed)


def drain(
    inp: Channel,
    out: Channel,
    device: torch.device,
    pool: ThreadPoolExecutor,
    codec: Codec,
    clock: StageClock,
    stats: StageStats,
    encode_clock: Callable[[float], None],
    layers: list[int] | None = None,
    on_nonfinite: str = "fail",
) -> None:
    """Drain thread: wait for each batch's D2H copy, apply --on-nonfinite, then submit one encode task per
    kept sample (the skipped ones travel to the writer as records)."""
    first_start = None
    span_before = stats.gpu_span_s  # a rank-0 takeover runs the stages a second time
    if device.type == "cuda":
        torch.cuda.set_device(device)
    while True:
        with clock.timing("wait_in"):
            item = inp.get()
            if item is not None and item.ready is not None:
                item.ready.synchronize()
        if item is None:
            break
        with clock.timing("busy"):
            if item.timing is not None:
                start, end = item.timing
                stats.gpu_compute_s += start.elapsed_time(end) / 1e3
                stats.batch_times.append((item.tokens, start.elapsed_time(end), item.host_ms))
                if first_start is None:
                    first_start = start
                stats.gpu_span_s = span_before + first_start.elapsed_time(end) / 1e3
            ids = item.input_ids.numpy()
            loss = item.loss_mask.numpy()
            bad = nonfinite_reasons(item.nonfinite, item.lengths, layers or [])
            futures: list[Future] = []
            skipped: list[dict[str, Any]] = []
            offset = 0
            lengths = item.lengths.tolist()
            for i, row in enumerate(item.rows.tolist()):
                n = lengths[i]
                if i in bad:
                    if on_nonfinite != "skip":
                        raise NonFiniteStates(
                            f"row {row}: the target produced {bad[i]}; check its weights and --dtype, or "
                            "pass --on-nonfinite skip to leave such rows out (listed as skipped in the manifest)"
                        )
                    skipped.append({"row": row, "reason": bad[i]})
                else:
                    parts = codec.batch_sample(item.features, lengths, i, offset)
                    futures.append(
                        pool.submit(_timed_encode, encode_clock, codec, row, ids[i, :n], loss[i, :n], parts)
                    )
                offset += n
        with clock.timing("wait_out"):
            out.put((item, futures, skipped))
    out.put(None)


def _timed_encode(report: Callable[[float], None], codec: Codec, *args: Any) -> EncodedSample:
    t = time.perf_counter()
    try:
        return encode_sample(codec, *args)
    finally:
        report(time.perf_counter() - t)


def write_shards(
    inp: Channel,
    shard_path: Callable[[int], Any],
    meta: Any,
    clock: StageClock,
    stats: StageStats,
    raw_bytes_per_token: int,
    progress: Any,
    commit_depth: int = COMMITS_IN_FLIGHT,
) -> None:
    """Writer thread: one ShardWriter per unit, samples in plan order; at the unit's last batch the shard is
    finished here and published (fsync + rename) by the Committer while the next unit streams in.
    `wait_out` counts the time the writer waited for the disk (every commit slot busy). Rows the drain
    skipped are listed in their unit's shard index (`meta.skipped`)."""
    writer: ShardWriter | None = None
    unit_skipped: list[dict[str, Any]] = []
    committer = Committer(commit_depth)
    t0 = time.perf_counter()
    try:
        while True:
            with clock.timing("wait_in"):
                got = inp.get()
            if got is None:
                break
            item, futures, skipped = got
            if item.first_in_unit:
                assert writer is None, "a unit started before the previous one was committed"
                writer = ShardWriter(shard_path(item.unit), dataclasses.replace(meta, extra=dict(meta.extra)))
                unit_skipped = []
            unit_skipped.extend(skipped)
            assert writer is not None
            before = 0 if item.first_in_unit else writer.bytes_written  # a shard's bytes include its header
            for f in futures:
                with clock.timing("wait_in"):
                    sample = f.result()
                with clock.timing("busy"):
                    writer.append(sample)
            with clock.timing("busy"):
                after = writer.bytes_written
                if item.last_in_unit:
                    if unit_skipped:
                        writer.meta.extra["skipped"] = unit_skipped
                    info = writer.finish()
                    after = info.bytes  # index and footer included
                    stats.shards.append(info)
            if item.last_in_unit:
                with clock.timing("wait_out"):
                    committer.submit(writer)
                writer = None
            with clock.timing("busy"):
                written = after - before
                stats.rows += len(item.rows) - len(skipped)
                stats.rows_nonfinite += len(skipped)
                stats.tokens += item.tokens
                stats.raw_bytes += item.tokens * raw_bytes_per_token
                stats.bytes_written += written
                if progress is not None:
                    progress.update(len(item.rows))
                    elapsed = max(time.perf_counter() - t0, 1e-9)
                    progress.set_postfix(
                        tok_s=f"{stats.tokens / elapsed:,.0f}",
                        MB_s=f"{stats.bytes_written / elapsed / 1e6:,.1f}",
                        ratio=f"{stats.raw_bytes / max(stats.bytes_written, 1):.2f}x",
                        refresh=False,
                    )
        with clock.timing("wait_out"):
            committer.drain()  # the run's manifest lists what is on disk: every shard must be there
    finally:
        if writer is not None:
            writer.abort()
        committer.close()
