"""What either loader (`loader.StreamingLoader`'s threads, `loader_procs.ProcessLoader`'s workers) hands the
training thread: a `LoadedBatch` per `Job` of the plan, then `END`; and the stop-aware `put` their stages feed
each other with."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from .blocks import PackedBatch
from .data_plan import SampleRef

END = object()  # the end of a loader's stream of batches (the thread and the process loader's)


def stoppable_put(stop: threading.Event) -> Callable[[queue.Queue, object], bool]:
    """`put(q, item)` that waits for room until `stop` is set (then False: the consumer is gone)."""

    def put(q: queue.Queue, item: object) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    return put


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
    slot_sums: tuple[float, ...] = ()  # the same per block slot (slot_weights.ReachWeights rescales slots)
    ready: torch.cuda.Event | None = None  # set on CUDA by the copy thread

    def scalars(self) -> dict[str, Any]:
        """Every field but the batch and its event, as JSON values (what a loader worker sends beside it)."""
        return {name: getattr(self, name) for name in _SCALAR_FIELDS}

    @classmethod
    def of_scalars(
        cls, batch: PackedBatch, scalars: dict[str, Any], ready: torch.cuda.Event | None = None
    ) -> LoadedBatch:
        """The inverse of `scalars` (JSON gives `slot_sums` back as a list)."""
        values = {name: scalars[name] for name in _SCALAR_FIELDS}
        return cls(batch=batch, ready=ready, **{**values, "slot_sums": tuple(values["slot_sums"])})

    def wait(self) -> PackedBatch:
        """The batch, safe to use on the current CUDA stream (a no-op on the CPU)."""
        if self.ready is not None:
            current = torch.cuda.current_stream(self.batch.features.device)
            current.wait_event(self.ready)
            for t in self.batch.tensors():  # keep the allocator from recycling them under the side stream
                t.record_stream(current)
            self.ready = None
        return self.batch


# LoadedBatch's fields a loader worker sends as JSON (`scalars`): all but the batch and its CUDA event.
_SCALAR_FIELDS = tuple(f.name for f in fields(LoadedBatch) if f.name not in ("batch", "ready"))


@dataclass(slots=True)
class Job:
    """One batch of the plan: its epoch, its index in the epoch, and its samples (built by either loader)."""

    epoch: int
    index: int
    next_index: int  # global index where the next group of this epoch starts (for the state)
    samples: list[SampleRef]
