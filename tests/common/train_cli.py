"""How tests and smoke scripts start `dflash-train`: the tiny-preset argument list and the torchrun prefix."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path


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
