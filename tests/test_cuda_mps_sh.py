"""`bench/cuda_mps.sh`: CUDA MPS for runs side by side, on when a client gets through it, else off in one line and
nothing left behind (a run must never wait on a broken MPS). A fake `nvidia-cuda-mps-control` stands in."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "bench" / "cuda_mps.sh"
SHOW = 'echo "ON=$CUDA_MPS_ON PIPE=${CUDA_MPS_PIPE_DIRECTORY:-}"'


def _source(tmp_path: Path, daemon_rc: int | None, check: str = "true") -> tuple[str, str]:
    """stdout of `source cuda_mps.sh DIR` and what the fake daemon was told (its log)."""
    bin_dir, told = tmp_path / "bin", tmp_path / "told"
    bin_dir.mkdir()
    if daemon_rc is not None:
        fake = bin_dir / "nvidia-cuda-mps-control"
        fake.write_text(
            "#!/bin/bash\n"
            f'if [ "$1" = -d ]; then echo "start $CUDA_MPS_PIPE_DIRECTORY" >>{told}; '
            f'[ {daemon_rc} = 0 ] || echo "An instance of this daemon is already running"; exit {daemon_rc}; fi\n'
            f"cat >>{told}\n"
        )
        fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "MPS_CHECK": check}
    done = subprocess.run(
        ["bash", "-c", f'source "{SCRIPT}" "{tmp_path / "mps"}"; {SHOW}'],
        capture_output=True, text=True, timeout=30, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout, told.read_text() if told.exists() else ""


def test_mps_is_on_when_a_client_gets_through_the_daemon(tmp_path: Path) -> None:
    # the check runs with the daemon's pipe directory in its environment, as the runs started after it will
    out, told = _source(
        tmp_path, 0, check='test "$CUDA_MPS_PIPE_DIRECTORY" = "' + str(tmp_path / "mps/pipe") + '"'
    )
    assert out.splitlines() == [
        f"cuda_mps: on (pipes in {tmp_path / 'mps/pipe'}; processes started from this shell share the GPU)",
        f"ON=1 PIPE={tmp_path / 'mps/pipe'}",
    ]
    assert told == f"start {tmp_path / 'mps/pipe'}\n"


@pytest.mark.parametrize(
    ("daemon_rc", "check", "why", "quit_sent"),
    [
        (None, "true", "no nvidia-cuda-mps-control on PATH", False),
        (1, "true", "the daemon did not start: An instance of this daemon is already running", False),
        (0, "echo 'RuntimeError: CUDA error: all CUDA-capable devices are busy'; exit 1",
         "a CUDA client failed through it: RuntimeError: CUDA error: all CUDA-capable devices are busy", True),
    ],
)  # fmt: skip
def test_mps_is_off_in_one_line_and_the_runs_go_on_without_it(
    tmp_path: Path, daemon_rc: int | None, check: str, why: str, quit_sent: bool
) -> None:
    out, told = _source(tmp_path, daemon_rc, check)
    assert out.splitlines() == [f"cuda_mps: off ({why}); runs time-slice the GPU", "ON=0 PIPE="]
    assert told.endswith("quit\n") == quit_sent  # a daemon whose client failed is stopped, not left running
