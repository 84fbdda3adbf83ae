"""The streaming loader: shard indexes -> decoded samples -> packed blocks -> (pinned) device batches.

Stages, each feeding the next through a bounded queue, all stopped by one event:

    planner thread   walks `data_plan` (one shard index at a time) and submits one read per sample
    decode pool      `loader_threads` threads: pread + checksum + decompress only the needed layers
    build pool       anchors, blocks and packing on the CPU (`make_packed_batch`), FlexAttention's tiles
                     (CUDA, `block_mask.TileLayout`: the training thread launches none of their kernels),
                     then pinning (CUDA)
    copy thread      (CUDA only) host-to-device copy on a side stream, an event per batch
    consumer         `iterate()`: yields (LoadedBatch, state_dict) in plan order
The planner, pool and copy threads run torch on themselves alone (`shards/threads.py`); the consumer, the
training thread, keeps its count. `loader_procs.ProcessLoader` (the default on CUDA) runs the planning, reads
and packing in worker processes instead, off the training thread's GIL, and yields the same batches.

An fp8 or q4/q6 cache is read undecoded on CUDA (`dequantize=False`): batches carry fp8 bits or int8 codes
plus their scales, about half the bytes of bf16 to pin and copy, and the copy thread decodes them on the
GPU. The CPU's share is then decompression alone; its fp8-to-bf16 conversion capped the loader at ~31k
tokens/s on 16 cores.

The plan, the anchors (a generator seeded from (seed, epoch, batch)) and the corrupt-sample skips are
functions of the data only, so `state_dict()` after a batch is all a resume needs to continue exactly.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from dflash.shards import Cache, Sample
from dflash.shards.errors import ShardError
from dflash.shards.layers import check_cached
from dflash.shards.threads import keep_own_threads, one_torch_thread

from .blocks import PackedBatch
from .config import TrainConfig
from .data_plan import SampleRef, ShardEntries, epoch_batches, group_for_ranks
from .data_spec import DataSpec, read_sample, shard_entries
from .loaded_batch import END, Job, LoadedBatch, stoppable_put
from .mask import flex_failure, flex_possible

if TYPE_CHECKING:
    from .drafter_config import DrafterConfig

log = logging.getLogger(__name__)
_ANCHOR_TAG = 0x414E


def anchor_generator(seed: int, epoch: int, global_index: int) -> torch.Generator:
    """The anchor sampler of one batch: independent of threads, ranks and resumes."""
    state = np.random.SeedSequence([seed, epoch, global_index, _ANCHOR_TAG]).generate_state(2, np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


class StreamingLoader:
    """Streams a cache for `epochs` epochs from a resumable position; see the module docstring."""

    def __init__(
        self,
        cache: Cache,
        spec: DataSpec,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | None = None,
    ) -> None:
        check_cached(spec.layer_ids, cache.layers)
        self.cache, self.spec = cache, spec
        self.rank, self.world_size = rank, world_size
        device = device or torch.device("cpu")
        if device.type == "cuda" and device.index is None:
            # A side thread starts on device 0, so the copier needs the concrete index.
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        # fp8/q frames stay undecoded until the batch is on the device (default: on CUDA; tests force it on a CPU).
        on_device = device.type == "cuda" if spec.dequantize_on_device is None else spec.dequantize_on_device
        self.decode_on_device = on_device and cache.codec.device_decode
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
        """The loader a run with `cfg` trains from (`DataSpec.for_run`; `overrides` replace single fields)."""
        spec = DataSpec.for_run(cfg, drafter_cfg, heldout_rows, **overrides)
        return cls(cache, spec, rank=rank, world_size=world_size, device=device)

    # --- position ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """The position after the last batch `iterate()` yielded (JSON-able). `skipped_samples` counts this
        rank's skips; the trainer saves their sum over ranks (`load_state_dict` gives it back to rank 0)."""
        return {**self._state, "seed": self.spec.seed, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("seed", self.spec.seed) != self.spec.seed:
            raise ValueError(
                f"loader state was saved with seed {state['seed']}, this run has seed {self.spec.seed}"
            )
        self._state = {k: int(state[k]) for k in ("epoch", "next_index", "skipped_samples")}
        if self.rank != 0:  # the saved count is every rank's: rank 0 carries it, so the sum stays right
            self._state["skipped_samples"] = 0

    # --- shard access (the cache keeps an LRU of open shards) ----------------------------------------

    def entries_of(self, name: str) -> ShardEntries:
        """A shard's index for the planner; an unreadable index skips the whole shard under `skip`."""
        return shard_entries(self.cache, name, self.spec.on_corrupt, self.bad_shards)

    def _plan(self, epoch: int, start_index: int) -> Iterator[Job]:
        """This rank's jobs of one epoch from global batch `start_index` (a group boundary)."""
        spec = self.spec
        stream = epoch_batches(
            [(info.name, info.rows) for info in self.cache.shard_infos],
            self.entries_of,
            order=spec.order,
            seed=spec.seed,
            epoch=epoch,
            window=spec.shuffle_window,
            token_budget=spec.token_budget,
            max_length=spec.max_length,
            heldout_fraction=spec.heldout_fraction,
            heldout_rows=spec.heldout_rows,
        )
        for _ in range(start_index):  # skipping needs shard indexes only: nothing is decompressed
            if next(stream, None) is None:
                return
        index = start_index
        for group in group_for_ranks(stream, self.world_size):
            yield Job(epoch, index + self.rank, index + self.world_size, group[self.rank])
            index += self.world_size

    def jobs(self) -> Iterator[Job]:
        """This rank's jobs from the saved position to the last epoch's end."""
        epoch, start = self._state["epoch"], self._state["next_index"]
        for e in range(epoch, self.spec.epochs):
            planned = 0
            for job in self._plan(e, start if e == epoch else 0):
                planned += 1
                yield job
            if not planned and self.bad_shards and (e > epoch or start == 0):
                raise ShardError(self._nothing_left())

    # --- stages ------------------------------------------------------------------------------------

    def read(self, ref: SampleRef) -> Sample | ShardError:
        return read_sample(self.cache, ref, self.spec, dequantize=not self.decode_on_device)

    def _build(self, job: Job, reads: list[Future]) -> LoadedBatch:
        """The job's batch, ready for the copy thread (pinned, CUDA) or the training thread (CPU)."""
        loaded = self.pack_job(job, reads, tiles=self.device.type == "cuda")
        # On CUDA the copy thread dequantizes fp8 batches on the GPU; elsewhere it happens here.
        batch = loaded.batch
        loaded.batch = batch.pin_memory() if self.device.type == "cuda" else batch.dequantized()
        return loaded

    def pack_job(self, job: Job, reads: list[Future], *, tiles: bool) -> LoadedBatch:
        """The job's samples packed into blocks (and FlexAttention's tiles when `tiles`), as read."""
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
        batch = self.spec.pack(samples, generator=anchor_generator(self.spec.seed, job.epoch, job.index))
        # FlexAttention's tiles here, not on the training thread (`block_mask.TileLayout`); not once training
        # gave FlexAttention up: its dense fallback never reads them
        if tiles and flex_possible(batch, self.spec.attention) and not flex_failure("train"):
            batch = batch.with_tile_layout(context_only=self.spec.split_own_slots)
        rows = [s.row for s in samples] if loss_scale else []
        slot_sums = tuple(float(w) * loss_scale for w in batch.weights.sum(0).tolist())
        return LoadedBatch(
            batch,
            rows,
            batch.num_context_tokens,
            loss_scale,
            job.epoch,
            job.index,
            skipped,
            weight_sum=float(batch.weights.sum()) * loss_scale,
            slot_sums=slot_sums,
        )

    def _filler(self) -> Sample:
        """A two-token sample with all layers zero: gives a rank with no data something to compute on."""
        width = self.cache.manifest.hidden_size
        zeros = torch.zeros(2, width, dtype=getattr(torch, self.cache.manifest.dtype))
        if self.decode_on_device:  # the codec's own undecoded form of zeros
            codec = self.cache.codec
            zeros = codec.decode_block(codec.encode(zeros), (2, width))
        return Sample(
            row=-1,
            input_ids=torch.zeros(2, dtype=torch.long),
            loss_mask=torch.ones(2, dtype=torch.bool),
            hidden={i: zeros for i in self.spec.layer_ids},
        )

    def warm_up(self) -> None:
        """Start what `iterate` will need ahead of it (nothing for threads; `ProcessLoader` starts its workers)."""

    def close(self) -> None:
        """Release what `warm_up` started and no `iterate()` used."""

    def iterate(self) -> Iterator[tuple[LoadedBatch, dict[str, int]]]:
        """Yield (batch, state after it) until the last epoch ends; closing the generator stops every stage."""
        keep_own_threads()  # the training thread's CPU ops keep every core
        stop = threading.Event()
        built: queue.Queue = queue.Queue(maxsize=self.spec.prefetch_batches)
        decode_pool = ThreadPoolExecutor(  # more on object storage: those threads mostly wait on the network
            self.spec.loader_threads * self.cache.read_fanout,
            thread_name_prefix="dflash-decode",
            initializer=one_torch_thread,
        )
        build_pool = ThreadPoolExecutor(2, thread_name_prefix="dflash-build", initializer=one_torch_thread)
        put = stoppable_put(stop)

        def planner() -> None:
            try:
                one_torch_thread()
                for job in self.jobs():
                    reads = [decode_pool.submit(self.read, ref) for ref in job.samples]
                    if not put(built, (job, build_pool.submit(self._build, job, reads))):
                        return
                put(built, END)
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
            yield from self._deliver(source)
        finally:
            # Every thread is joined before this returns: none may read the cache after its owner closes it.
            stop.set()
            for t in threads:
                t.join()
            decode_pool.shutdown(wait=True, cancel_futures=True)
            build_pool.shutdown(wait=True, cancel_futures=True)

    def _deliver(self, source: queue.Queue) -> Iterator[tuple[LoadedBatch, dict[str, int]]]:
        """The consumer's side: (batch, state after it) in plan order; a stage's exception raised here."""
        while True:
            item = source.get()
            if item is END:
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

    def _nothing_left(self) -> str:
        """An epoch with no batch once shards were skipped (a manifest that disagrees with every shard, under
        --on-corrupt skip): the run would end at once and still export an untrained drafter."""
        name, reason = next(iter(self.bad_shards.items()))
        return (
            f"{self.cache.location}: {len(self.bad_shards)} of {len(self.cache.shard_names)} shards skipped under "
            f"--on-corrupt skip leave nothing to train on (the first, {name}: {reason:.300}); run "
            f"`dflash-shards verify {self.cache.location}`"
        )

    def _copier(self, built: queue.Queue, out: queue.Queue, put, stop: threading.Event) -> None:
        """Host-to-device copies on a side stream, one batch ahead of the consumer."""
        try:
            one_torch_thread()
            stream = self._side_stream()
            while not stop.is_set():
                try:
                    item = built.get(timeout=0.1)
                except queue.Empty:
                    continue
                if item is END or isinstance(item, BaseException):
                    put(out, item)
                    return
                job, fut = item
                loaded: LoadedBatch = fut.result()
                loaded.batch, _, loaded.ready = self._to_device(loaded.batch, stream)
                if not put(out, (job, loaded)):
                    return
        except BaseException as exc:
            put(out, exc)

    def _side_stream(self) -> torch.cuda.Stream:
        """A copy thread's device set-up: this loader's device, a stream of its own."""
        torch.cuda.set_device(self.device)  # a new thread starts on device 0
        return torch.cuda.Stream(device=self.device)

    def _to_device(
        self, batch: PackedBatch, stream: torch.cuda.Stream
    ) -> tuple[PackedBatch, torch.cuda.Event, torch.cuda.Event]:
        """`batch` copied to the device and decoded there (fp8/q), on `stream`: (batch, copied, ready), the
        events after the copy (its host memory may be reused) and after the decode (the batch may be used)."""
        with torch.cuda.stream(stream):
            batch = batch.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
            batch = batch.dequantized()
            ready = torch.cuda.Event()
            ready.record(stream)
        return batch, copied, ready
