"""bench_quality's children stop with it: SIGTERM to the benchmark passes SIGTERM to the extractions and runs it
started (they were left running, writing into the work folder, when only the benchmark was killed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_BENCH = textwrap.dedent(
    """
    import sys, threading
    sys.path.insert(0, {root!r})
    from pathlib import Path
    from bench import quality_phases
    quality_phases.stop_children_on_signals()
    child = [sys.executable, "-c", "import os, time; open({pid!r}, 'w').write(str(os.getpid())); time.sleep(120)"]
    worker = threading.Thread(target=quality_phases._call, args=(child, Path({log!r})), daemon=True)
    worker.start()  # as the benchmark's runs do: the main thread only waits
    worker.join()
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_sigterm_to_the_benchmark_stops_the_child_it_waits_on(tmp_path: Path) -> None:
    pid_file, log = tmp_path / "child.pid", tmp_path / "child.log"
    script = _BENCH.format(root=str(ROOT), pid=str(pid_file), log=str(log))
    bench = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and bench.poll() is None, "the child never started"
        time.sleep(0.05)
    child = int(pid_file.read_text())
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, "the child outlived the benchmark"
        time.sleep(0.05)
