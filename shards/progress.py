"""Progress of long steps: a tqdm bar on a terminal, else a periodic line with rate and ETA.

A log file (the demo's `OUT/logs/STEP.log`, a batch job's stderr) gets no tqdm bar: tqdm either stays
silent there or rewrites one line with carriage returns. `ProgressLine` prints a whole line every
`every_s` seconds instead: `train 450/1000 steps (45%), 3.2 steps/s, ETA 2:51, loss 0.52`. It speaks
the part of tqdm's interface dflash uses (`n`, `update`, `set_postfix`, `write`, `close`), so a caller
holds either without knowing which.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import IO, Any, Protocol

PROGRESS_EVERY_S = 5.0  # a line at least this often while work advances (the demo promises one per 10 s)
# Past the first ~8 minutes the gap grows with the elapsed time (1% of it), up to a line a minute: a three-day
# extraction or training logs ~4,600 lines, not the ~52,000 a fixed 5 s would write.
STRETCH = 0.01
PROGRESS_MAX_EVERY_S = 60.0


class Progress(Protocol):
    n: int

    def update(self, n: int = 1) -> Any: ...
    def set_postfix(
        self, ordered_dict: Mapping[str, Any] | None = None, refresh: bool = True, **kw: Any
    ) -> Any: ...
    def write(self, s: str, file: IO[str] | None = None) -> Any: ...
    def close(self) -> Any: ...


def format_eta(seconds: float) -> str:
    """'0:45', '12:03', '1:02:03'; '?' when unknown."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class ProgressLine:
    """Counts work done and prints `desc n/total unit (pct), rate unit/s, ETA t, postfix` at most every
    `interval()` seconds of `clock` (a test passes a fake one), and once more on `close` if it printed before.

    The stream is looked up when a line is printed (default: the current `sys.stderr`), so output
    redirected after construction (the demo's per-step logs) still lands where it is sent."""

    def __init__(
        self,
        desc: str,
        total: int | None,
        unit: str = "it",
        *,
        initial: int = 0,
        every_s: float = PROGRESS_EVERY_S,
        stream: IO[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if every_s <= 0:
            raise ValueError(f"every_s must be > 0, got {every_s}")
        self.desc, self.total, self.unit = desc, total, unit
        self.n = self._start_n = initial
        self.every_s = every_s
        self._stream = stream
        self._clock = clock
        self._start = self._last = clock()
        self._fields: dict[str, Any] = {}
        self._closed = False
        self._emitted_n: int | None = None  # the count the last line showed

    def _out(self) -> IO[str]:
        return self._stream if self._stream is not None else sys.stderr

    def line(self) -> str:
        """The current progress as one line (no newline)."""
        elapsed = max(self._clock() - self._start, 1e-9)
        rate = (self.n - self._start_n) / elapsed
        if self.total:
            text = f"{self.desc} {self.n:,}/{self.total:,} {self.unit} ({100 * self.n / self.total:.0f}%)"
            text += f", {rate:,.2f} {self.unit}/s"
            if "eta" not in self._fields:  # the caller's own estimate (training's excludes start-up) wins
                text += f", ETA {format_eta((self.total - self.n) / rate) if rate > 0 else '?'}"
        else:
            text = f"{self.desc} {self.n:,} {self.unit}, {rate:,.2f} {self.unit}/s"
        text += f", {format_eta(elapsed)} elapsed"
        return ", ".join([text, *(f"{k} {v}" for k, v in self._fields.items())])

    def _emit(self) -> None:
        out = self._out()
        out.write(self.line() + "\n")
        out.flush()
        self._last = self._clock()
        self._emitted_n = self.n

    def interval(self) -> float:
        """Seconds between lines now: `every_s`, or 1% of the elapsed time once that is longer, at most a
        minute (never less than `every_s`)."""
        stretched = min(STRETCH * (self._clock() - self._start), PROGRESS_MAX_EVERY_S)
        return max(self.every_s, stretched)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._clock() - self._last >= self.interval():
            self._emit()

    def set_postfix(
        self, ordered_dict: Mapping[str, Any] | None = None, refresh: bool = True, **kw: Any
    ) -> None:
        self._fields = {**(ordered_dict or {}), **kw}

    def write(self, s: str, file: IO[str] | None = None) -> None:
        out = file or self._out()
        out.write(s + "\n")
        out.flush()

    def close(self) -> None:
        """A last line with the totals, when a line was printed before (quick work stays silent) and the
        count moved since."""
        if not self._closed:
            self._closed = True
            if self._emitted_n is not None and self._emitted_n != self.n:
                self._emit()


def progress_bar(
    desc: str,
    total: int | None,
    unit: str = "it",
    *,
    initial: int = 0,
    every_s: float = PROGRESS_EVERY_S,
    mininterval: float = 1.0,
) -> Progress:
    """A tqdm bar when stderr is a terminal, else a `ProgressLine` on stderr."""
    if sys.stderr.isatty():
        from tqdm.auto import tqdm

        return tqdm(
            total=total,
            initial=initial,
            unit=unit,
            desc=desc,
            dynamic_ncols=True,
            mininterval=mininterval,
            file=sys.stderr,
        )
    return ProgressLine(desc, total, unit, initial=initial, every_s=every_s)
