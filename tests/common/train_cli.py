"""How tests and smoke scripts start `dflash-train`: the tiny-preset argument list and the torchrun prefix."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def tiny_train_argv(cache: Path, out: Path, *options: str) -> list[str]:
    """`dflash-train` arguments: the tiny preset on `cache`, writing the run to `out`, then `options`."""
    return ["--preset", "tiny", "--cache", str(cache), "--out", str(out), *options]


def torchrun(nproc: int) -> list[str]:
    """The command prefix that starts `nproc` local processes (single node, rendezvous on localhost)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


# `python -c KILLER ARGV...`: dflash-train that SIGKILLs itself once step $KILL_AT_STEP is logged.
KILLER = textwrap.dedent("""
    import os, signal, sys
    from dflash.train import metrics
    kill_at = int(os.environ["KILL_AT_STEP"])
    original = metrics.MetricsLogger.log
    def log(self, record):
        original(self, record)
        if record["step"] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    metrics.MetricsLogger.log = log
    from dflash.train.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def _child(command: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        command,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=240,
    )


def train_killed_at(argv: Sequence[str], step: int) -> None:
    """`dflash-train argv` in a child that SIGKILLs itself once step `step` is logged."""
    killed = _child([sys.executable, "-c", KILLER, *argv], KILL_AT_STEP=str(step))
    assert killed.returncode == -9, killed.stderr[-2000:]


def train_resumed(argv: Sequence[str]) -> None:
    """`dflash-train argv --resume` in a child, to its end."""
    resumed = _child([sys.executable, "-m", "dflash.train.cli", *argv, "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
