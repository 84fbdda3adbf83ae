"""A stop asked for by a signal: `dflash-train` finishes its step, writes a checkpoint and exits.

Schedulers preempt with SIGTERM and a grace period before SIGKILL (SLURM's KillWait is 30 s by default,
Kubernetes' terminationGracePeriodSeconds 30 s): killed at once, a run would lose every step since its last
`--save-every` checkpoint. The first SIGTERM or SIGINT only sets `requested`; the trainer reads it at its next
step (every rank agrees through the step's own all-reduce), saves and stops. A second signal acts at once,
as without this handler. Installed by the command line only: a program that calls `train()` keeps its own
signal handling.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """`requested` is the signal that asked for a stop (None: none yet)."""

    def __init__(self) -> None:
        self.requested: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = signum
        for s, handler in self._previous.items():  # the next signal acts as it did before
            signal.signal(s, handler)

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Handle SIGTERM and SIGINT while the block runs (in the main thread only: elsewhere Python cannot
        install handlers, and this does nothing)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        # a signal ignored here (a job started under nohup ignores SIGINT) stays ignored; a handler set
        # outside Python (None) comes back as the default
        self._previous = {s: signal.getsignal(s) or signal.SIG_DFL for s in SIGNALS}
        self._previous = {s: h for s, h in self._previous.items() if h != signal.SIG_IGN}
        for s in self._previous:
            signal.signal(s, self._handle)
        try:
            yield self
        finally:
            for s, handler in self._previous.items():
                signal.signal(s, handler)


def exit_code(signum: int) -> int:
    """The shell's code for a process a signal ended (128 + its number): a scheduler reads a stop as one."""
    return 128 + signum
