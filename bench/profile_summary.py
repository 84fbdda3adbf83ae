"""Where a training step's time goes: torch.profiler over a few steps, summarized by kernel category.

    summary = profile_steps(run_steps, steps, device)   # {category: ms per step} + "wall", "busy"

Categories (per step, GPU kernel time on CUDA; CPU op self time on a CPU, which only checks the code path):
    lm_head/CE         kernels under a `dflash::lm_head_loss` annotation, and backward kernels of ops issued
                       under one (a reference's checkpoint recomputation and its matmul backward)
    optimizer          under `dflash::optimizer` (clipping, AdamW)
    attention          FlexAttention / SDPA kernels (names: flex_attention, fmha, flash, attention)
    matmul             GEMMs (cuBLAS/CUTLASS names: gemm, xmma, nvjet, cutlass, ...) outside the two above
    elementwise/norms  every other kernel: norms, RoPE, SwiGLU, casts, residual adds, copies
    idle               wall time minus the union of kernel intervals: the GPU waiting for the host
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import torch

CATEGORIES = ("matmul", "attention", "lm_head/CE", "elementwise/norms", "optimizer", "idle")
LOSS_MARK, OPTIMIZER_MARK = "dflash::lm_head_loss", "dflash::optimizer"
_ATTENTION = re.compile(r"flex_attention|fmha|flash|attention|sdpa", re.IGNORECASE)
_MATMUL = re.compile(
    r"gemm|xmma|nvjet|cutlass|cublas|wgmma|s16816|s1688|splitk|aten::(mm|addmm|bmm|matmul|linear)$",
    re.IGNORECASE,
)
_BACKWARD = "autograd::engine::evaluate_function"


def _ancestors(event: Any) -> list[Any]:
    out = []
    while event is not None:
        out.append(event)
        event = event.cpu_parent
    return out


def _loss_sequence_numbers(events: list[Any]) -> set[tuple[int, int]]:
    """(thread, autograd sequence number) of forward ops issued under the loss annotation: their backward
    nodes (which carry the forward thread and number) belong to the loss too."""
    seqs: set[tuple[int, int]] = set()
    for event in events:
        seq = getattr(event, "sequence_nr", -1)
        if seq < 0 or event.name.startswith(_BACKWARD):
            continue
        names = [a.name for a in _ancestors(event)]
        if LOSS_MARK in names and not any(n.startswith(_BACKWARD) for n in names):  # forward, not recompute
            seqs.add((event.thread, seq))
    return seqs


def _category(name: str, ancestors: list[Any], loss_seqs: set[tuple[int, int]]) -> str:
    names = [a.name for a in ancestors]
    if OPTIMIZER_MARK in names:
        return "optimizer"
    if LOSS_MARK in names or any(
        a.name.startswith(_BACKWARD) and (a.fwd_thread, a.sequence_nr) in loss_seqs for a in ancestors
    ):
        return "lm_head/CE"
    if _ATTENTION.search(name):
        return "attention"
    if _MATMUL.search(name):
        return "matmul"
    return "elementwise/norms"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def _is(event: Any, kind: str) -> bool:
    return str(event.device_type).endswith(kind)


def summarize(events: list[Any], wall_s: float, steps: int, cuda: bool) -> dict[str, float]:
    """ms per step by category, plus "wall" and "busy" (union of kernel intervals; CPU: op time)."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    loss_seqs = _loss_sequence_numbers(events)
    cpu = [e for e in events if _is(e, "CPU") and not e.is_async]
    if cuda:
        # Each kernel links to the CPU op that launched it; a kernel without one (say, launched by compiled
        # code outside any op) is still classified by its name.
        launched_by = {e.id: e for e in cpu}
        kernels = [e for e in events if _is(e, "CUDA")]
        for kernel in kernels:
            owner = launched_by.get(getattr(kernel, "linked_correlation_id", None))
            duration = kernel.time_range.end - kernel.time_range.start
            totals[_category(kernel.name, _ancestors(owner), loss_seqs)] += duration
        busy_us = _union_us([(k.time_range.start, k.time_range.end) for k in kernels])
    else:
        for event in cpu:
            if not event.name.startswith("dflash::"):  # annotations' own time is Python between ops
                totals[_category(event.name, _ancestors(event), loss_seqs)] += event.self_cpu_time_total
        busy_us = sum(totals.values())
    wall_us = wall_s * 1e6
    totals["idle"] = max(0.0, wall_us - busy_us)
    out = {k: v / 1e3 / steps for k, v in totals.items()}
    out["wall"] = wall_us / 1e3 / steps
    out["busy"] = busy_us / 1e3 / steps
    return out


def profile_steps(run: Callable[[], None], steps: int, device: torch.device) -> dict[str, float]:
    """Profile `run` (which performs `steps` training steps) and summarize per step."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    return summarize(list(prof.events()), wall, steps, cuda)


def format_row(label: str, summary: dict[str, float]) -> str:
    wall = max(summary["wall"], 1e-9)
    cells = [f"{summary[c]:7.1f} ({100 * summary[c] / wall:4.1f}%)" for c in CATEGORIES]
    return f"{label:<14}{summary['wall']:8.1f}  " + "  ".join(cells)


def header() -> str:
    return f"{'variant':<14}{'ms/step':>8}  " + "  ".join(f"{c:>15}" for c in CATEGORIES)
