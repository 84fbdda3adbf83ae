"""The streaming loader with its reading and packing in worker processes, off the training process's GIL.

    workers (processes)   `loader_worker.py`: each plans the run's jobs, keeps every W-th, reads, decompresses
                          and packs them (FlexAttention's tiles too) into its own shared-memory slots
    receiver thread       takes the workers' batches in plan order (job i comes from worker i % W), copies
                          each to the device on a side stream (CUDA) or out of the slot (CPU), gives the slot
                          back, and queues the batch for `iterate()`

Why: with the loader's threads inside the training process, every kernel the training thread launches
releases the GIL and must take it back from them, and the full-size drafter trained at 8-12 steps/s where
the same step alone runs 19 (BENCHMARKS.md). The batches are the thread loader's exactly (same plan, same
anchor generators), so a run may switch between the two on resume. Processes share JSON lines on pipes and
tensors in slot files; nothing is pickled. A worker that dies or fails stops the run with one line naming
it; the slot files are removed by the workers and again by the parent. `warm_up()` starts the processes
early (the trainer calls it before building the drafter: each interpreter imports torch for ~4 s); they get
their configuration, the loader's position included, when `iterate()` begins.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import queue
import secrets
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import torch
from dflash.shards import errors as shard_errors
from dflash.shards.retries import merge_counts
from dflash.shards.threads import keep_own_threads, one_torch_thread

from . import batch_wire
from .data_spec import DataSpec
from .loaded_batch import END, Job, LoadedBatch, stoppable_put
from .loader import StreamingLoader
from .mask import flex_failure

log = logging.getLogger(__name__)
_STOP_WAIT_S = 10.0


def slot_dir() -> Path:
    """Shared memory where the system has it (Linux), else the temp folder (a page-cached file)."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def worker_error(worker: int, kind: str, text: str) -> BaseException:
    """A worker's failure as the parent raises it, one line either way (the CLI prints it): data errors keep
    their class; anything else is the worker process failing (its traceback went to stderr)."""
    cls = getattr(shard_errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, shard_errors.ShardError):
        # ManifestMismatch is built from its parts, not a message: the base class carries the line
        return shard_errors.ShardError(text) if cls is shard_errors.ManifestMismatch else cls(text)
    if kind == "ValueError":
        return ValueError(text)
    return ChildProcessError(f"loader worker {worker} failed: {kind}: {text}")


@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen
    ctl: BinaryIO  # parent -> worker: configuration, then freed slots
    msg: BinaryIO  # worker -> parent: one line per batch
    slots: list[str]
    maps: dict[int, mmap.mmap]

    def receive(self) -> dict[str, Any]:
        line = self.msg.readline()
        if not line:
            code = self.proc.wait()
            raise ChildProcessError(
                f"loader worker {self.index} (pid {self.proc.pid}) exited with code {code} before the end of its "
                "batches; see its message above, or the system log if it was killed (out of memory?)"
            )
        return json.loads(line)

    def buffer(self, k: int, size: int) -> mmap.mmap:
        """Slot k mapped at least `size` bytes long (the worker grows a slot that a batch outgrew)."""
        held = self.maps.get(k)
        if held is None or len(held) < size:
            with open(self.slots[k], "r+b") as f:
                held = self.maps[k] = mmap.mmap(f.fileno(), size)
        return held

    def free(self, k: int) -> None:
        with contextlib.suppress(BrokenPipeError):  # a worker that died: its next `receive` says so
            self.ctl.write(json.dumps({"free": k}).encode() + b"\n")
            self.ctl.flush()


class ProcessLoader(StreamingLoader):
    """`StreamingLoader` whose stages run in `spec.loader_workers` processes (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.worker_pids: list[int] = []  # of the last `iterate()`, and their exit codes once it ended
        self.worker_exit_codes: list[int | None] = []
        self._spare: list[_Worker] | None = None  # started by `warm_up`, configured by the next `iterate`

    def warm_up(self) -> None:
        """Start the workers now: their interpreters import torch (~4 s) while the caller sets up the rest."""
        if self._spare is None:
            self._spare = self._spawn()

    def close(self) -> None:
        """End workers that `warm_up` started and no `iterate()` used (they wait for their configuration)."""
        spare, self._spare = self._spare, None
        if spare:
            self._stop(spare)

    def _config(self, worker: int, workers: int, slots: list[str]) -> dict[str, Any]:
        spec = self.spec
        return {
            "cache": self.cache.location,
            # a remote cache: the parent's local copy and its whole-shard cache (processes may share it)
            "local_dir": str(self.cache.path) if self.cache.storage is not None else None,
            "shard_cache_bytes": self.cache.shard_cache_bytes,
            "spec": spec.to_json(),
            "rank": self.rank,
            "world_size": self.world_size,
            "state": self.state_dict(),
            "decode_on_device": self.decode_on_device,
            "tiles": self.device.type == "cuda",
            "worker": worker,
            "workers": workers,
            # zstd and preads release the GIL: two threads keep one worker's packing fed
            "decode_threads": max(2, -(-spec.loader_threads // workers)),
            "slots": slots,
        }

    def _spawn(self) -> list[_Worker]:
        """The worker processes, started and waiting for their configuration."""
        workers = self.spec.loader_workers
        slots_each = max(2, -(-self.spec.prefetch_batches // workers))
        stem = slot_dir() / f"dflash-loader-{os.getpid()}-{secrets.token_hex(4)}"
        started: list[_Worker] = []
        try:
            for w in range(workers):
                ctl_r, ctl_w = os.pipe()
                msg_r, msg_w = os.pipe()
                cmd = [sys.executable, "-m", "dflash.train.loader_worker", str(ctl_r), str(msg_w)]
                try:
                    proc = subprocess.Popen(cmd, pass_fds=(ctl_r, msg_w), stdin=subprocess.DEVNULL)
                finally:
                    os.close(ctl_r)
                    os.close(msg_w)
                slots = [f"{stem}-w{w}-s{k}" for k in range(slots_each)]
                started.append(_Worker(w, proc, os.fdopen(ctl_w, "wb"), os.fdopen(msg_r, "rb"), slots, {}))
        except BaseException:
            self._stop(started)
            raise
        return started

    def _start(self) -> list[_Worker]:
        """Workers (the warm ones, else new) configured from the current position."""
        workers, self._spare = self._spare or self._spawn(), None
        try:
            for w in workers:
                w.ctl.write(json.dumps(self._config(w.index, len(workers), w.slots)).encode() + b"\n")
                w.ctl.flush()
        except BaseException:
            self._stop(workers)
            raise
        return workers

    def _stop(self, workers: list[_Worker]) -> None:
        for w in workers:
            with contextlib.suppress(OSError):
                w.ctl.close()  # end of file: the worker stops at its next wait for a slot
        for w in workers:
            try:
                w.proc.wait(timeout=_STOP_WAIT_S)
            except subprocess.TimeoutExpired:  # busy decoding a large batch: it writes nothing we still need
                w.proc.kill()
                w.proc.wait()
            else:
                if w.proc.returncode < 0:  # a signal from elsewhere ended it (the OOM killer, a stray kill)
                    log.warning(
                        "loader worker %d (pid %d) was ended by signal %d",
                        w.index,
                        w.proc.pid,
                        -w.proc.returncode,
                    )
            w.msg.close()
            for path in w.slots:  # a killed worker cannot remove its own
                Path(path).unlink(missing_ok=True)
        self.worker_exit_codes = [w.proc.returncode for w in workers]

    def _receive(self, workers: list[_Worker], out: queue.Queue, put: Any, stop: threading.Event) -> None:
        """The receiver thread: batches in plan order from the workers, to the device, slots given back."""
        try:
            cuda = self.device.type == "cuda"
            one_torch_thread()
            stream = self._side_stream() if cuda else None
            ordinal = 0
            while not stop.is_set():
                worker = workers[ordinal % len(workers)]
                record = worker.receive()
                if record.get("end"):
                    put(out, END)
                    return
                if "error" in record:
                    raise worker_error(worker.index, record.get("kind", ""), record["error"])
                self._note(record)
                k = int(record["slot"])
                views = batch_wire.read_tensors(worker.buffer(k, int(record["size"])), record["layout"])
                batch = batch_wire.unflatten(record["tree"], views)
                if batch.tile_layout is not None and flex_failure("train"):
                    batch = replace(batch, tile_layout=None)
                if cuda:
                    batch, copied, ready = self._to_device(batch, stream)
                    copied.synchronize()  # the slot's bytes are on the device: the worker may reuse it
                else:
                    batch, ready = batch.clone().dequantized(), None
                del views
                worker.free(k)
                loaded = LoadedBatch.of_scalars(batch, record, ready)
                job = Job(record["epoch"], record["index"], record["next_index"], [])
                if not put(out, (job, loaded)):
                    return
                ordinal += 1
        except BaseException as exc:
            put(out, exc)

    def _note(self, record: dict[str, Any]) -> None:
        """What a worker skipped, logged here (the run's log) and counted as the thread loader counts it, and
        the object-storage requests and retries it made (`shards.storage` counts)."""
        for name, reason in record.get("bad_shards", {}).items():
            if name not in self.bad_shards:
                self.bad_shards[name] = reason
                log.warning("skipping shard %s: %s", name, reason)
        for text in record.get("corrupt", []):
            if len(self.corrupt_messages) < 100:
                self.corrupt_messages.append(text)
            log.warning("skipping corrupt sample: %s", text)
        storage = record.get("storage")
        if storage:
            merge_counts(storage.get("transient", {}), storage.get("requests", {}))

    def iterate(self) -> Iterator[tuple[LoadedBatch, dict[str, int]]]:
        keep_own_threads()
        stop = threading.Event()
        out: queue.Queue = queue.Queue(maxsize=2)
        put = stoppable_put(stop)
        workers = self._start()
        self.worker_pids = [w.proc.pid for w in workers]
        receiver = threading.Thread(
            target=self._receive, args=(workers, out, put, stop), name="dflash-receive", daemon=True
        )
        receiver.start()
        try:
            yield from self._deliver(out)
        finally:
            stop.set()
            self._stop(workers)  # unblocks a receiver waiting on a worker's pipe
            receiver.join()


DEFAULT_CUDA_WORKERS = 4  # full size: ~25 steps/s against 8-12 with threads (BENCHMARKS.md)


def streaming_loader(cache: Any, spec: DataSpec, **kwargs: Any) -> StreamingLoader:
    """The run's loader: `spec.loader_workers` processes (None: 4 on CUDA, none on a CPU), else threads."""
    workers = spec.loader_workers
    if workers is None:
        device = kwargs.get("device")
        workers = DEFAULT_CUDA_WORKERS if device is not None and torch.device(device).type == "cuda" else 0
        spec = replace(spec, loader_workers=workers)
    return (ProcessLoader if workers > 0 else StreamingLoader)(cache, spec, **kwargs)
