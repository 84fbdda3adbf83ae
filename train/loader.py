"""The streaming loader: shard indexes -> decoded samples -> packed blocks -> (pinned) device batches.

Stages, each feeding the next through a bounded queue, all stopped by one event:

    planner thread   walks `data_plan` (one shard index at a time) and submits one read per sample
    decode pool      `loader_threads` threads: pread + checksum + decompress only the needed layers
    build pool       anchors, blocks and packing on the CPU (`make_packed_batch`), then pinning (CUDA)
    copy thread      (CUDA only) host-to-device copy on a side stream, an event per batch

An fp8 cache is read undecoded on CUDA (`dequantize=False`): batches carry fp8 bits and per-token scales,
half the bytes of bf16 to pin and copy, and the copy thread dequantizes them on the GPU. The CPU's share
is then decompression alone; its fp8-to-bf16 conversion capped the loader at ~31k tokens/s on 16 cores.
    consumer         `iterate()`: yields (LoadedBatch, state_dict) in plan order

The plan, the anchors (a generator seeded from (seed, epoch, batch)) and the corrupt-sample skips are
functions of the data only, so `state_dict()` after a batch is all a resume needs to continue exactly.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from dflash.shards import Cache, Fp8Block, ShardReader
from dflash.shards.errors import ShardError

from .blocks import PackedBatch, make_packed_batch
from .cache_checks import check_layers
from .config import TrainConfig
from .data_plan import SampleRef, ShardEntries, epoch_batches, group_for_ranks

if TYPE_CHECKING:
    from .model import DrafterConfig

log = logging.getLogger(__name__)
_ANCHOR_TAG = 0x414E
_END = object()


class ShardsExhausted(Exception):
    """Raised by `next_batch` when every planned epoch has been delivered."""


def anchor_generator(seed: int, epoch: int, global_index: int) -> torch.Generator:
    """The anchor sampler of one batch: independent of threads, ranks and resumes."""
    state = np.random.SeedSequence([seed, epoch, global_index, _ANCHOR_TAG]).generate_state(2, np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


@dataclass(slots=True)
class LoadedBatch:
    batch: PackedBatch
    rows: list[int]  # dataset rows trained on in this batch (corrupt ones already dropped)
    tokens: int  # context tokens
    loss_scale: float  # 0.0: a filler batch (this rank had nothing left this epoch): compute, learn nothing
    epoch: int
    index: int  # global batch index within the epoch
    skipped: int  # corrupt samples dropped from this batch
    weight_sum: float = 0.0  # sum of loss weights (0 for a filler), known before the forward
    ready: torch.cuda.Event | None = None  # set on CUDA by the copy thread

    def wait(self) -> PackedBatch:
        """The batch, safe to use on the current CUDA stream (a no-op on the CPU)."""
        if self.ready is not None:
            current = torch.cuda.current_stream(self.batch.features.device)
            current.wait_event(self.ready)
            for t in self.batch.tensors():  # keep the allocator from recycling them under the side stream
                t.record_stream(current)
            self.ready = None
        return self.batch


@dataclass(slots=True)
class _Job:
    epoch: int
    index: int
    next_index: int  # global index where the next group of this epoch starts (for the state)
    samples: list[SampleRef]


class StreamingLoader:
    """Streams a cache for `epochs` epochs from a resumable position; see the module docstring."""

    def __init__(
        self,
        cache: Cache,
        *,
        layer_ids: Sequence[int],
        block_size: int,
        mask_token_id: int,
        num_anchors: int,
        gamma: float,
        token_budget: int,
        max_length: int,
        shuffle_window: int,
        loader_threads: int,
        prefetch_batches: int,
        on_corrupt: str,
        heldout_fraction: float,
        heldout_rows: frozenset[int] = frozenset(),
        seed: int,
        epochs: int,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | None = None,
        pad_blocks_to_multiple: int = 1,
        dequantize_on_device: bool | None = None,
    ) -> None:
        check_layers(layer_ids, cache.layers)
        self.cache = cache
        self.layer_ids = list(layer_ids)
        self.block_size, self.mask_token_id, self.num_anchors, self.gamma = (
            block_size,
            mask_token_id,
            num_anchors,
            gamma,
        )
        self.token_budget, self.max_length, self.shuffle_window = token_budget, max_length, shuffle_window
        self.loader_threads, self.prefetch_batches = loader_threads, prefetch_batches
        self.on_corrupt = on_corrupt
        self.heldout_fraction, self.heldout_rows = heldout_fraction, heldout_rows
        self.seed, self.epochs, self.rank, self.world_size = seed, epochs, rank, world_size
        device = device or torch.device("cpu")
        if device.type == "cuda" and device.index is None:
            # A side thread starts on device 0, so the copier needs the concrete index.
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.pad_blocks_to_multiple = pad_blocks_to_multiple
        # fp8 frames stay fp8 until the batch is on the device (default: on CUDA; tests force it on a CPU).
        on_device = device.type == "cuda" if dequantize_on_device is None else dequantize_on_device
        self.fp8_on_device = on_device and cache.codec.name == "fp8"
        self.bad_shards: dict[str, str] = {}
        self.corrupt_messages: list[str] = []
        self._state = {"epoch": 0, "next_index": 0, "skipped_samples": 0}

    @classmethod
    def for_run(
        cls,
        cache: Cache,
        cfg: TrainConfig,
        drafter_cfg: DrafterConfig,
        *,
        heldout_rows: frozenset[int] = frozenset(),
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | None = None,
        **overrides: Any,
    ) -> StreamingLoader:
        """The loader a run with `cfg` trains from: the drafter's layers and blocks, the run's data settings.

        `overrides` replace single settings (benchmarks use them, e.g. `loader_threads`)."""
        settings: dict[str, Any] = dict(
            layer_ids=drafter_cfg.target_layer_ids,
            block_size=drafter_cfg.block_size,
            mask_token_id=drafter_cfg.mask_token_id,
            num_anchors=cfg.drafter.num_anchors,
            gamma=cfg.drafter.loss_gamma,
            token_budget=cfg.data.token_budget,
            max_length=cfg.data.max_length,
            shuffle_window=cfg.data.shuffle_window,
            loader_threads=cfg.data.loader_threads,
            prefetch_batches=cfg.data.prefetch_batches,
            on_corrupt=cfg.data.on_corrupt,
            heldout_fraction=cfg.data.eval_fraction,
            heldout_rows=heldout_rows,
            seed=cfg.seed,
            epochs=cfg.optim.epochs,
            rank=rank,
            world_size=world_size,
            device=device,
        )
        return cls(cache, **{**settings, **overrides})

    # --- position ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """The position after the last batch `iterate()` yielded (JSON-able)."""
        return {**self._state, "seed": self.seed, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(
                f"loader state was saved with seed {state['seed']}, this run has seed {self.seed}"
            )
        self._state = {k: int(state[k]) for k in ("epoch", "next_index", "skipped_samples")}

    # --- shard access (the cache keeps an LRU of open shards) ----------------------------------------

    def entries_of(self, name: str) -> ShardEntries:
        """A shard's index for the planner; an unreadable index skips the whole shard under `skip`."""
        try:
            entries = self.cache.shard(name).entries
        except (ShardError, OSError) as exc:
            if self.on_corrupt != "skip":
                raise ShardError(f"{exc} (pass --on-corrupt skip to train without this shard)") from None
            if name not in self.bad_shards:
                self.bad_shards[name] = str(exc)
                log.warning("skipping shard %s: %s", name, exc)
            return ShardEntries(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
        return ShardEntries(
            rows=np.fromiter((e.row for e in entries), np.int64, len(entries)),
            lengths=np.fromiter((e.length for e in entries), np.int64, len(entries)),
            supervised=np.fromiter((e.supervised for e in entries), np.int64, len(entries)),
        )

    def _plan(self, epoch: int, start_index: int) -> Iterator[_Job]:
        """This rank's jobs of one epoch from global batch `start_index` (a group boundary)."""
        stream = epoch_batches(
            self.cache.shard_names,
            self.entries_of,
            seed=self.seed,
            epoch=epoch,
            window=self.shuffle_window,
            token_budget=self.token_budget,
            max_length=self.max_length,
            heldout_fraction=self.heldout_fraction,
            heldout_rows=self.heldout_rows,
        )
        for _ in range(start_index):  # skipping needs shard indexes only: nothing is decompressed
            if next(stream, None) is None:
                return
        index = start_index
        for group in group_for_ranks(stream, self.world_size):
            yield _Job(epoch, index + self.rank, index + self.world_size, group[self.rank])
            index += self.world_size

    # --- stages ------------------------------------------------------------------------------------

    def _read(self, ref: SampleRef, reader: ShardReader) -> object | ShardError:
        try:
            # Cut to --max-length while decoding: the tokens past it are never decompressed.
            return reader.read(
                ref.index, self.layer_ids, dequantize=not self.fp8_on_device, max_tokens=self.max_length
            )
        except ShardError as exc:
            if self.on_corrupt != "skip":
                raise ShardError(f"{exc} (pass --on-corrupt skip to drop corrupt samples)") from None
            return exc

    def _build(self, job: _Job, reads: list[Future]) -> LoadedBatch:
        samples, skipped = [], 0
        for ref, fut in zip(job.samples, reads, strict=True):
            result = fut.result()
            if isinstance(result, ShardError):
                skipped += 1
                if len(self.corrupt_messages) < 100:
                    self.corrupt_messages.append(str(result))
                log.warning("skipping corrupt sample (row %d): %s", ref.row, result)
            else:
                samples.append(result)
        loss_scale = 1.0
        if not samples:  # nothing left for this rank (epoch tail or all corrupt): a zero-weight step
            loss_scale = 0.0
            samples = [self._filler()]
        batch = make_packed_batch(
            samples,
            block_size=self.block_size,
            mask_token_id=self.mask_token_id,
            num_anchors=self.num_anchors,
            gamma=self.gamma,
            generator=anchor_generator(self.seed, job.epoch, job.index),
            layer_ids=self.layer_ids,
            pad_blocks_to_multiple=self.pad_blocks_to_multiple,
        )
        # On CUDA the copy thread dequantizes fp8 batches on the GPU; elsewhere it happens here.
        batch = batch.pin_memory() if self.device.type == "cuda" else batch.dequantized()
        rows = [s.row for s in samples] if loss_scale else []
        weight_sum = float(batch.weights.sum()) * loss_scale
        return LoadedBatch(
            batch, rows, batch.num_context_tokens, loss_scale, job.epoch, job.index, skipped, weight_sum
        )

    def _filler(self) -> object:
        """A two-token sample with all layers zero: gives a rank with no data something to compute on."""
        from dflash.shards import Sample

        width = self.cache.manifest.hidden_size
        zeros = (
            Fp8Block(q=torch.zeros(2, width, dtype=torch.uint8), scale=torch.ones(2))
            if self.fp8_on_device
            else torch.zeros(2, width, dtype=getattr(torch, self.cache.manifest.dtype))
        )
        return Sample(
            row=-1,
            input_ids=torch.zeros(2, dtype=torch.long),
            loss_mask=torch.ones(2, dtype=torch.bool),
            hidden={i: zeros for i in self.layer_ids},
        )

    def iterate(self) -> Iterator[tuple[LoadedBatch, dict[str, int]]]:
        """Yield (batch, state after it) until the last epoch ends; closing the generator stops every stage."""
        stop = threading.Event()
        built: queue.Queue = queue.Queue(maxsize=self.prefetch_batches)
        decode_pool = ThreadPoolExecutor(self.loader_threads, thread_name_prefix="dflash-decode")
        build_pool = ThreadPoolExecutor(2, thread_name_prefix="dflash-build")

        def put(q: queue.Queue, item: object) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def planner() -> None:
            try:
                epoch, start = self._state["epoch"], self._state["next_index"]
                for e in range(epoch, self.epochs):
                    for job in self._plan(e, start if e == epoch else 0):
                        reads = [
                            decode_pool.submit(self._read, ref, self.cache.shard(ref.shard))
                            for ref in job.samples
                        ]
                        if not put(built, (job, build_pool.submit(self._build, job, reads))):
                            return
                put(built, _END)
            except BaseException as exc:
                put(built, exc)

        threads = [threading.Thread(target=planner, name="dflash-planner", daemon=True)]
        source = built
        if self.device.type == "cuda":
            source = queue.Queue(maxsize=2)
            threads.append(
                threading.Thread(
                    target=self._copier, args=(built, source, put, stop), name="dflash-h2d", daemon=True
                )
            )
        for t in threads:
            t.start()
        try:
            while True:
                item = source.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                job, loaded = item
                if isinstance(loaded, Future):
                    loaded = loaded.result()
                self._state = {
                    "epoch": job.epoch,
                    "next_index": job.next_index,
                    "skipped_samples": self._state["skipped_samples"] + loaded.skipped,
                }
                yield loaded, self.state_dict()
        finally:
            stop.set()
            decode_pool.shutdown(wait=False, cancel_futures=True)
            build_pool.shutdown(wait=False, cancel_futures=True)
            for t in threads:
                t.join(timeout=5)

    def _copier(self, built: queue.Queue, out: queue.Queue, put, stop: threading.Event) -> None:
        """Host-to-device copies on a side stream, one batch ahead of the consumer."""
        try:
            torch.cuda.set_device(self.device)  # a new thread starts on device 0
            stream = torch.cuda.Stream(device=self.device)
            while not stop.is_set():
                try:
                    item = built.get(timeout=0.1)
                except queue.Empty:
                    continue
                if item is _END or isinstance(item, BaseException):
                    put(out, item)
                    return
                job, fut = item
                loaded: LoadedBatch = fut.result()
                with torch.cuda.stream(stream):
                    loaded.batch = loaded.batch.to(self.device, non_blocking=True).dequantized()
                    loaded.ready = torch.cuda.Event()
                    loaded.ready.record(stream)
                if not put(out, (job, loaded)):
                    return
        except BaseException as exc:
            put(out, exc)
