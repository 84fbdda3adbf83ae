"""Where a training process's host threads spend their time, from a py-spy profile of a running `dflash-train`:

    py-spy record -p PID -d 30 -r 100 -f raw -t --idle -o spy_raw.txt    # on the GPU box (bench/quality_profile.sh)
    py-spy record -p PID -d 30 -r 100 -f raw -t --gil -o spy_gil.txt     # right after: GIL holders only
    python bench/spy_summary.py spy_raw.txt [--gil spy_gil.txt]

A small drafter's step is host-bound on an H200 (the GPU waits for launches), so the training thread's
Python time, not kernel time, sets steps/s: this splits that thread's samples by what the step was doing
(the first matching frame, innermost first, decides) and shows how busy every other thread was. Input: py-spy's
raw format with thread ids (`-t`): one line per distinct stack, `thread (TID): NAME;frame;...;frame COUNT`.

py-spy counts a thread blocked inside a C call (a CUDA sync, a lock) as busy; `--gil` tells the two apart: a
profile taken with `--gil` holds only samples of the thread holding the GIL, so per thread its count over the
`--idle` profile's (every thread, every tick; same length and rate) is the share of time that thread held the
GIL, and the shares' sum is how busy the GIL itself was: near 100%, the Python threads wait for one another.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

# (part, frame pattern), innermost match wins: a Dynamo compile inside a region counts as compiling.
PARTS: tuple[tuple[str, str], ...] = (
    ("dynamo compile (recompiles)", r"convert_frame\.py"),
    ("block mask", r"\(train/block_mask\.py"),
    ("attention (FlexAttention call)", r"FlexMask\.(attend|_flex)|DenseMask\.attend"),
    ("loss (lm_head + CE)", r"linear_cross_entropy|_LinearCrossEntropy|chunk_terms"),
    ("backward", r"Tensor\.backward|_engine_run_backward"),
    ("optimizer + clip", r"Optimizer|clip_grad|FiniteGuard\.record"),
    ("drafter forward (compiled regions)", r"DFlashDrafter\.forward"),
    ("waiting for a batch", r"LoadedBatch\.wait|_timed_next"),
    ("logging + evaluation", r"MetricsLogger|Trainer\.evaluate"),
)
# Leaf frames of a thread that waits (a native thread with no Python frame counts as waiting too).
IDLE = re.compile(
    r"Condition\.wait|_worker \(concurrent/futures/thread\.py|Queue\.get|Event\.wait|select|epoll|_recv_msg|"
    r"Timer\.check|sleep"
)


def read_raw(path: Path) -> list[tuple[str, list[str], int]]:
    """(thread, frames outermost first, samples) per line of a py-spy raw profile."""
    stacks = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        thread, *frames = stack.split(";")
        stacks.append((thread, frames, int(count)))
    return stacks


def part_of(frames: list[str]) -> str:
    """The step's part a training-thread sample belongs to (see PARTS)."""
    for frame in reversed(frames):
        for part, pattern in PARTS:
            if re.search(pattern, frame):
                return part
    return "other"


def summarize(stacks: list[tuple[str, list[str], int]], main: str = "MainThread") -> dict[str, Counter]:
    """{"threads": samples busy per thread (leaf frame not a wait), "total": samples per thread,
    "main": the training thread's samples per part}."""
    busy, total, parts = Counter(), Counter(), Counter()
    for thread, frames, n in stacks:
        total[thread] += n
        if frames and not IDLE.search(frames[-1]):
            busy[thread] += n
        if main in thread:
            parts[part_of(frames)] += n
    return {"threads": busy, "total": total, "main": parts}


def gil_shares(
    every: list[tuple[str, list[str], int]], holding: list[tuple[str, list[str], int]]
) -> dict[str, float]:
    """{thread: share of its ticks holding the GIL}: samples in the `--gil` profile over samples in the `--idle`
    one (every thread each tick), threads matched by py-spy's label (id and name)."""
    ticks, held = Counter(), Counter()
    for thread, _, n in every:
        ticks[thread] += n
    for thread, _, n in holding:
        held[thread] += n
    return {thread: held[thread] / n for thread, n in ticks.items() if n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("raw", type=Path)
    p.add_argument("--main", default="MainThread", help="the training thread's name")
    p.add_argument("--gil", type=Path, help="a `--gil` profile taken right after `raw`, same length and rate")
    args = p.parse_args()
    every = read_raw(args.raw)
    s = summarize(every, args.main)
    main_total = sum(s["main"].values()) or 1
    print("training thread, share of its samples by part of the step:")
    for part, n in s["main"].most_common():
        print(f"  {part:38s} {100 * n / main_total:5.1f}%")
    print("threads, share of samples busy (leaf frame not a wait):")
    for thread, n in s["total"].most_common():
        print(f"  {thread[:60]:60s} {100 * s['threads'][thread] / n:5.1f}%")
    if args.gil:
        holding = read_raw(args.gil)
        shares = gil_shares(every, holding)
        print("threads, share of ticks holding the GIL (the --gil profile over the --idle one):")
        for thread, share in sorted(shares.items(), key=lambda kv: -kv[1]):
            print(f"  {thread[:60]:60s} {100 * share:5.1f}%")
        print(f"  {'the GIL busy (their sum)':60s} {100 * sum(shares.values()):5.1f}%")
        held = summarize(holding, args.main)["main"]
        total = sum(held.values()) or 1
        print("training thread while it holds the GIL, by part of the step:")
        for part, n in held.most_common():
            print(f"  {part:38s} {100 * n / total:5.1f}%")


if __name__ == "__main__":
    main()
