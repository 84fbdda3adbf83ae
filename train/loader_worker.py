"""One loader process: reads, decompresses and packs its share of the run's batches into shared memory.

    python -m dflash.train.loader_worker CTL_FD MSG_FD      (started by `loader_procs.ProcessLoader`)

The parent writes one JSON line of configuration on CTL_FD, then `{"free": k}` each time it is done with
slot k. The worker plans the same jobs as the parent's `StreamingLoader` would, keeps every `workers`-th one
from its `worker` index, and for each writes the packed batch into a free slot (a file in shared memory,
`batch_wire` layout) and one JSON line on MSG_FD naming the slot and describing the batch; `{"end": true}`
after its last job (it then waits for CTL_FD to close: the parent may still be reading its slots), `{"error":
...}` (one line, the exception's class and message) when it cannot go on. End of file on CTL_FD (the parent
stopped or died) ends it quietly. Its slot files are removed on exit.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import signal
import sys
import traceback
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from typing import Any, BinaryIO

import torch
from dflash.shards import Cache
from dflash.shards.errors import ShardError
from dflash.shards.retries import request_counts, transient_counts
from dflash.shards.threads import one_torch_thread

from . import batch_wire
from .data_spec import DataSpec
from .loader import StreamingLoader


class ParentGone(Exception):
    """The control pipe closed: the parent stopped iterating (or died)."""


class Slots:
    """The worker's slot files: mapped once, grown when a batch does not fit, removed at the end."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self.free = list(range(len(paths)))
        self.maps: dict[int, mmap.mmap] = {}

    def take(self, ctl: BinaryIO) -> int:
        """A free slot, waiting for the parent to give one back when none is."""
        while not self.free:
            line = ctl.readline()
            if not line:
                raise ParentGone
            self.free.append(int(json.loads(line)["free"]))
        return self.free.pop(0)

    def buffer(self, k: int, size: int) -> mmap.mmap:
        held = self.maps.get(k)
        if held is None or len(held) < size:
            if held is not None:
                held.close()
            size = max(size + size // 4, 1 << 20)  # room to grow before the next remap
            fd = os.open(self.paths[k], os.O_RDWR | os.O_CREAT, 0o600)
            try:
                _reserve(fd, size, self.paths[k])
                held = self.maps[k] = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        return held

    def remove(self) -> None:
        for held in self.maps.values():
            held.close()
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _reserve(fd: int, size: int, path: str) -> None:
    """Give the slot file `size` bytes of real space now: in a full /dev/shm (a container's is 64 MB unless
    raised) a sparse file would be a SIGBUS at the first write into its mapping, not an error."""
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
        else:  # macOS: no reservation to be had
            os.ftruncate(fd, size)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        folder = os.path.dirname(path)
        raise OSError(
            exc.errno,
            f"no room for a {size / 2**20:.0f} MiB batch slot in {folder} (shared memory full? a container "
            "needs a larger --shm-size for the loader's worker processes; --loader-workers 0 uses none)",
        ) from None


def _my_jobs(loader: StreamingLoader, worker: int, workers: int) -> Iterator[Any]:
    return (job for i, job in enumerate(loader.jobs()) if i % workers == worker)


def _send(msg: BinaryIO, record: dict[str, Any]) -> None:
    msg.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")  # buffered: written whole
    msg.flush()


class CountsSince:
    """This process's object-storage counts (`shards.storage`) made since the last call: the parent adds them
    to its own, so a run's `storage_retries` and a benchmark's request counts include the workers'."""

    def __init__(self) -> None:
        self.transient: dict[str, int] = {}
        self.requests: dict[str, int] = {}

    def __call__(self) -> dict[str, dict[str, int]]:
        transient, requests = transient_counts(), request_counts()
        new = {"transient": _minus(transient, self.transient), "requests": _minus(requests, self.requests)}
        self.transient, self.requests = transient, requests
        return new


def _minus(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}


def serve(config: dict[str, Any], ctl: BinaryIO, msg: BinaryIO, slots: Slots) -> None:
    """Pack this worker's jobs into slots until the plan ends (see the module docstring)."""
    one_torch_thread()
    spec = DataSpec.from_json(config["spec"])
    opened = Cache.open(
        config["cache"],
        local_dir=config.get("local_dir"),
        shard_cache_bytes=config.get("shard_cache_bytes", 0),
    )
    with opened as cache:
        loader = StreamingLoader(cache, spec, rank=config["rank"], world_size=config["world_size"])
        loader.decode_on_device = bool(config["decode_on_device"])
        loader.load_state_dict(config["state"])
        # more on object storage, as in the thread loader: those threads mostly wait on the network
        decode = ThreadPoolExecutor(
            config["decode_threads"] * cache.read_fanout, initializer=one_torch_thread
        )
        try:
            jobs = _my_jobs(loader, config["worker"], config["workers"])
            ahead: deque = deque()

            def submit(job: Any) -> None:  # reads run ahead of the packing, as far as there are slots
                ahead.append((job, [decode.submit(loader.read, ref) for ref in job.samples]))

            for job in islice(jobs, len(slots.paths)):
                submit(job)
            reported_bad, reported_corrupt = 0, 0
            counts = CountsSince()
            while ahead:
                job, reads = ahead.popleft()
                following = next(jobs, None)
                if following is not None:
                    submit(following)
                loaded = loader.pack_job(job, reads, tiles=config["tiles"])
                tree, tensors = batch_wire.flatten(loaded.batch)
                layout, size = batch_wire.place(tensors)
                k = slots.take(ctl)
                buffer = slots.buffer(k, size)
                batch_wire.write_tensors(buffer, tensors, layout)
                bad = list(loader.bad_shards.items())[reported_bad:]
                corrupt = loader.corrupt_messages[reported_corrupt:]
                reported_bad, reported_corrupt = reported_bad + len(bad), reported_corrupt + len(corrupt)
                record = loaded.scalars() | {"next_index": job.next_index}
                record |= {"slot": k, "size": len(buffer), "tree": tree, "layout": layout}
                _send(msg, record | {"bad_shards": dict(bad), "corrupt": corrupt, "storage": counts()})
            _send(msg, {"end": True})
            while ctl.readline():  # the parent may not have read the last slots yet: keep them until it stops
                pass
        finally:
            decode.shutdown(wait=True, cancel_futures=True)


def main() -> int:
    ctl = os.fdopen(int(sys.argv[1]), "rb")
    msg = os.fdopen(int(sys.argv[2]), "wb")
    # The parent logs what matters (skipped shards and samples) from the messages; only errors here.
    logging.basicConfig(level=logging.ERROR, format="dflash loader worker: %(message)s")
    torch.set_num_threads(1)
    # A scheduler's SIGTERM (or a terminal's Ctrl-C) reaches the whole process group: the trainer then
    # finishes its step and saves, which needs its workers; they end when it closes their pipe or dies.
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    slots = Slots([])
    try:
        line = ctl.readline()
        if not line:
            return 0
        config = json.loads(line)
        slots = Slots(list(config["slots"]))
        serve(config, ctl, msg, slots)
        return 0
    except (ParentGone, BrokenPipeError, KeyboardInterrupt):
        return 0
    except BaseException as exc:
        if not isinstance(
            exc, (ShardError, ValueError)
        ):  # not bad data: a bug or the machine, keep the trace
            traceback.print_exc()
        text = " ".join(str(exc).split()) or type(exc).__name__
        with contextlib.suppress(OSError):
            _send(msg, {"error": text, "kind": type(exc).__name__})
        return 1
    finally:
        slots.remove()


if __name__ == "__main__":
    code = main()  # its slot files removed, its cache closed, its threads joined
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: the interpreter's teardown with torch loaded takes ~0.3 s, and the parent waits for every
    # worker's exit at the end of its data, inside the trainer's last wait for a batch (BENCHMARKS.md).
    os._exit(code)
