"""A scheduler's SIGTERM (or Ctrl-C) stops `dflash-train` after its step with a checkpoint there, on every rank
at the same step; `--resume` then goes on as if nothing had happened."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from dflash.train import checkpoint as ckpt
from dflash.train.metrics import read_metrics
from dflash.train.stop_signal import StopRequest

from tests.common.fake_cache import write_fake_cache
from tests.common.train_cli import REPO, tiny_train_argv, torchrun

STEPS = 120
FLAGS = (
    "--max-steps",
    str(STEPS),
    "--epochs",
    "100",
    "--save-every",
    "50",
    "--eval-every",
    "40",
    "--log-every",
    "1",
)
FLAGS += ("--no-tensorboard", "--no-plots", "--device", "cpu")
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return write_fake_cache(tmp_path_factory.mktemp("stop") / "cache", num_samples=40, samples_per_shard=10)


def _train(argv: list[str], **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dflash.train.cli", *argv]
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _wait_for_step(run: Path, proc: subprocess.Popen, step: int) -> None:
    deadline = time.monotonic() + 120
    while not any(r["step"] >= step for r in read_metrics(run)):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, f"the run never logged step {step}"
        time.sleep(0.02)


def _trajectory(run: Path) -> list[tuple]:
    """Every logged step's numbers (a resumed launch's repeats of steps already logged: the later ones)."""
    by_step = {r["step"]: (r["loss"], r["lr"], r["grad_norm"], r.get("tau")) for r in read_metrics(run)}
    return [(s, *by_step[s]) for s in sorted(by_step)]


@pytest.mark.parametrize(
    ("workers", "group"),
    [(0, False), (2, True)],  # threads, the signal to the trainer; worker processes, to the process group
)
def test_a_signal_stops_after_the_step_with_a_checkpoint_and_resume_goes_on_bit_for_bit(
    cache: Path, tmp_path: Path, workers: int, group: bool
) -> None:
    reference = tmp_path / "reference"
    done = _train(tiny_train_argv(cache, reference, *FLAGS))
    assert done.wait(timeout=300) == 0, done.communicate()[1][-2000:]

    run = tmp_path / "run"
    argv = tiny_train_argv(cache, run, *FLAGS, "--loader-workers", str(workers))
    proc = _train(argv, start_new_session=True)
    _wait_for_step(run, proc, 3)
    os.killpg(proc.pid, signal.SIGTERM) if group else proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    stopped = read_metrics(run)[-1]["step"]
    assert 3 <= stopped < STEPS
    assert f"stopped by SIGTERM after step {stopped}, checkpoint" in err and "--resume" in err
    assert "Traceback" not in err and "loader worker" not in err  # the workers outlived the signal
    assert [s for s, _ in ckpt.list_checkpoints(run)][-1] == stopped  # saved at the stop, not at step 50

    resumed = _train([*argv, "--resume"])
    assert resumed.wait(timeout=300) == 0, resumed.communicate()[1][-2000:]
    assert _trajectory(run) == _trajectory(reference)  # the steps after the stop as if it never happened


_RANK1_SIGNALS_ITSELF = textwrap.dedent("""
    import os, signal, sys
    from dflash.train import trainer
    original = trainer.Trainer.train_step
    def train_step(self, micro):
        result = original(self, micro)
        if self.info.rank == 1 and self.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # rank 1 alone: rank 0 learns it from the next step's reduce
        return result
    trainer.Trainer.train_step = train_step
    from dflash.train.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(cache: Path, tmp_path: Path) -> None:
    script = tmp_path / "signal_rank1.py"
    script.write_text(_RANK1_SIGNALS_ITSELF)
    run = tmp_path / "run"
    cmd = [*torchrun(2), str(script), *tiny_train_argv(cache, run, *FLAGS)]
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0  # torchrun reports rank 0's 143 as a failed job, as a scheduler should see it
    assert "stopped by SIGTERM after step 4, checkpoint" in done.stderr, done.stderr[-3000:]
    assert read_metrics(run)[-1]["step"] == 4 and [s for s, _ in ckpt.list_checkpoints(run)][-1] == 4


def test_the_second_signal_acts_at_once_and_handlers_come_back() -> None:
    # SIGINT's handler as this process found it: Python's default, or SIG_IGN under a shell's background job
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stop = StopRequest()
    with stop.installed():
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        signal.raise_signal(signal.SIGTERM)  # the first: noted, not acted on
        assert stop.requested == signal.SIGTERM
        # the next one meets the handler from before
        assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]
    assert {s: signal.getsignal(s) for s in before} == before
