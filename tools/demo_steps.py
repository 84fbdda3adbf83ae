"""The demo's step runner: times each step, sends its own output to `OUT/logs/STEP.log`, prints one line
when it ends and, while it runs, a heartbeat line every few seconds with the step's latest progress.

The heartbeat is what a user watching the console sees during the long steps (the target's training,
the drafter's training): without it nothing printed for minutes. It repeats the last line the step wrote
to its log (the progress lines of `dflash.shards.progress`), or only the elapsed time if there is none.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

HEARTBEAT_S = 8.0  # the demo promises a sign of life at least every 10 s
_TAIL_BYTES = 4096
_LINE_CHARS = 140


def last_log_line(path: Path) -> str:
    """The last non-blank line of a log (a tqdm bar's carriage-return updates count as lines), shortened."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - _TAIL_BYTES))
            tail = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.replace("\r", "\n").split("\n") if line.strip()]
    if not lines:
        return ""
    line = lines[-1]
    return line if len(line) <= _LINE_CHARS else line[: _LINE_CHARS - 3] + "..."


class Steps:
    """Runs the named steps; `timings` holds each one's wall and CPU seconds."""

    def __init__(
        self, out: Path, verbose: bool, *, heartbeat_s: float = HEARTBEAT_S, console: IO[str] | None = None
    ) -> None:
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.verbose = verbose
        self.heartbeat_s = heartbeat_s
        self.console = console
        self.timings: dict[str, dict[str, float]] = {}

    def log_path(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def run(self, name: str, fn: Callable[[], Any], describe: Callable[[Any], str]) -> Any:
        console = self.console or sys.stdout  # the real console: looked up before the step's redirect
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            with self._captured(name), self._heartbeat(name, console, wall):
                value = fn()
                line = describe(value)
                print(line)  # the step's log ends with what the console shows
        except BaseException:
            if not self.verbose:
                print(f"[{name:>8}] failed; its output is in {self.log_path(name)}", file=sys.stderr)
            raise
        seconds, cpu_seconds = time.perf_counter() - wall, time.process_time() - cpu
        self.timings[name] = {"seconds": round(seconds, 2), "cpu_seconds": round(cpu_seconds, 2)}
        print(f"[{name:>8}] {line} ({seconds:.1f} s, CPU {cpu_seconds:.1f} s)", file=console, flush=True)
        return value

    @contextlib.contextmanager
    def _heartbeat(self, name: str, console: IO[str], start: float) -> Iterator[None]:
        if self.verbose:  # the step's own progress is on the console already
            yield
            return
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.heartbeat_s):
                latest = last_log_line(self.log_path(name))
                running = f"running {time.perf_counter() - start:.0f} s"
                console.write(f"[{name:>8}] {running}" + (f": {latest}" if latest else "") + "\n")
                console.flush()

        thread = threading.Thread(target=beat, name=f"dflash-demo-{name}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    @contextlib.contextmanager
    def _captured(self, name: str) -> Iterator[None]:
        if self.verbose:
            yield
            return
        with (
            open(self.log_path(name), "w", encoding="utf-8", buffering=1) as log,
            contextlib.redirect_stdout(log),
            contextlib.redirect_stderr(log),
        ):
            yield
