"""torch's intra-op threads in the project's worker threads.

    torch_threads(n)     context: the count for the length of a block, restored after it (whatever it raises)
    one_torch_thread()   a worker thread's initializer: its torch ops run on itself alone
    keep_own_threads()   called by the thread that starts such workers, first (see below)

Every pipeline here (extraction's encoders, the training loader, convert) parallelizes with its own
threads. Left at the default, each of those threads' torch ops (copies, casts, pinning) fans out over an
OpenMP team as wide as the machine: on a 16-core H200 box, three training runs side by side spent their CPU
in spin-waits and context switches (~550k/s) and their steps waited for data ~15% of the time; one torch
thread per loader thread made it ~1-3% (BENCHMARKS.md). The setting is per thread: the thread that trains
or runs the forward keeps its own, provided it fixed it first: torch keeps the count per thread, but a
thread takes the last value any thread set at its first torch op (`keep_own_threads` makes that op happen).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    import torch  # here, not at import: light paths (the CLI's errors, the dry run) never load torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def one_torch_thread() -> None:
    import torch

    torch.set_num_threads(1)


def keep_own_threads() -> int:
    """Fix the calling thread's intra-op count (before it starts workers that call `one_torch_thread`)."""
    import torch

    return torch.get_num_threads()
