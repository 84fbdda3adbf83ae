"""Wall seconds of a launch's set-up, phase by phase, to the end of its first optimizer step (issue 13).

    clock = StartupClock()                  the total starts here (`Trainer.build`'s first line)
    with clock.phase("cache_open"): ...     adds the block's seconds to the phase (one may be timed in parts)
    clock.add("first_batch", seconds)       adds seconds measured elsewhere
    clock.finish() -> {"<phase>_s": ..., "total_s": ...}        describe(record) -> one line for people

Phases, in the order they run (`PHASES`; one not reached reads 0):
    process_group     torchrun's process group, the CUDA device (its context)
    run_dir           --out claimed, interrupted saves cleaned, the checkpoint check, seeds (ranks meet here)
    cache_open        the manifest read and checked, each listed shard stat'ed (present, its recorded size)
    target_files      CACHE/target/'s files hashed and compared with the manifest's digests (reads them whole)
    frozen_read       frozen target headers and config, layers, drafter config, cache checks (no weight data)
    frozen_to_device  embed/lm_head copied to the device in their stored dtype, then cast there
    frozen_check      their NaN/inf count where they are (on the CPU this reads the mmap'd file first)
    drafter           drafter initialised on the device
    compile_setup     the compile wrappers installed (torch.compile imports Dynamo; compiling waits for step 1)
    optimizer         AdamW, DDP wrap, NaN guard, slot weights (the loader is made just before `drafter`,
                      untimed: on CUDA its worker processes import torch while `drafter` and what follows run)
    resume            a checkpoint read back (`--resume`)
    logger            metrics.jsonl, TensorBoard writer, progress bar, config.json
    first_batch       loader threads started (or its workers told where to start) and the batches of step 1
                      (and the next one) delivered
    first_step        step 1's forward, backward and update, compilation included (on CUDA up to a sync)
Times are rounded down to the millisecond and the total up, so the phases never sum past the total; the
rest (Python between phases) is what they leave out.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Mapping

PHASES = (
    "process_group",
    "run_dir",
    "cache_open",
    "target_files",
    "frozen_read",
    "frozen_to_device",
    "frozen_check",
    "drafter",
    "compile_setup",
    "optimizer",
    "resume",
    "logger",
    "first_batch",
    "first_step",
)


class StartupClock:
    """Seconds per phase of `PHASES`, and the total from construction to `finish()`."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t)

    def add(self, name: str, seconds: float) -> None:
        if name not in self.seconds:
            raise KeyError(f"unknown start-up phase {name!r} (known: {', '.join(PHASES)})")
        self.seconds[name] += seconds

    def finish(self) -> dict[str, float]:
        """The record: each phase's seconds and the total since the clock started."""
        total = time.perf_counter() - self.start
        record = {f"{k}_s": math.floor(v * 1000) / 1000 for k, v in self.seconds.items()}
        return {**record, "total_s": math.ceil(total * 1000) / 1000}


def describe(record: Mapping[str, float]) -> str:
    """One line: the total, then in the order they ran the phases of 0.01 s or more, then the rest."""
    phases = {k.removesuffix("_s"): v for k, v in record.items() if k != "total_s"}
    shown = ", ".join(f"{k} {v:.2f}" for k, v in phases.items() if v >= 0.01) or "no phase over 0.01"
    total = record["total_s"]
    rest = total - sum(phases.values())
    return f"start-up {total:.2f} s to the end of the first step: {shown}, other {rest:.2f} (seconds)"
