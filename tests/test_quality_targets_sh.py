"""`bench/quality_targets.sh poll`: what a device call following detached runs brings back and prints."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path


def _poll(work: Path, dest: Path, seconds: int = 300) -> subprocess.CompletedProcess:
    script = Path(__file__).parents[1] / "bench" / "quality_targets.sh"
    argv = ["bash", str(script), "poll", str(work), str(seconds), str(dest)]
    env = {**os.environ, "POLL_EVERY": "0.2"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=20, env=env)


def test_poll_ends_at_once_on_a_machine_that_did_not_start_the_runs(tmp_path: Path) -> None:
    # A device call that lands on a fresh machine once polled an empty folder for its whole 560 s.
    done = _poll(tmp_path / "qt", tmp_path / "dest")
    assert done.returncode == 3
    assert "no run logs under" in done.stderr and "qt" in done.stderr
    assert not (tmp_path / "dest").exists()


def test_poll_copies_an_ended_runs_report_and_evaluations_then_stops(tmp_path: Path) -> None:
    work = tmp_path / "qt"
    run = work / "code" / "runs" / "base-fp8-f1-s0"
    run.mkdir(parents=True)
    evaluation = {"step": 1500, "tau": 5.0, "tau_walk": 3.9, "tau_walk_lookup": 2.8}
    lines = [json.dumps(evaluation), json.dumps({"step": 1510, "loss": 2.0})]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (work / "code" / "runs" / "quality.json").write_text('{"runs": []}')
    (work / "code.log").write_text("[train] 900 s\n== exit 0\n")
    (work / "pack").mkdir()
    (work / "pack" / "quality-work.txz.00").write_bytes(b"part")
    done = _poll(work, tmp_path / "dest")
    assert done.returncode == 0, done.stderr
    assert "base-fp8-f1-s0: step 1510; last eval step 1500, tau 5.0, tau_walk 3.9" in done.stdout
    tail = (tmp_path / "dest" / "code.log.tail").read_text()
    assert "== exit 0" in tail and '"tau_walk": 3.9' in tail
    assert json.loads((tmp_path / "dest" / "code-quality.json").read_text()) == {"runs": []}
    assert (tmp_path / "dest" / "quality-work.txz.00").read_bytes() == b"part"  # `--pack W/pack` comes back


def test_poll_prints_a_targets_phase_once_and_every_runs_step_each_round(tmp_path: Path) -> None:
    # A device call's reply keeps only the end of its output: one unchanged phase line a round filled it.
    work = tmp_path / "qt"
    run = work / "hybrid" / "runs" / "base-fp8-f1-s0"
    run.mkdir(parents=True)
    evaluation = {
        "step": 1000,
        "tau": 3.2671588678,
        "tau_walk": 2.7475787941,
        "tau_walk_lookup": 2.7554869492,
    }
    (run / "metrics.jsonl").write_text(json.dumps(evaluation) + "\n")
    (work / "hybrid.log").write_text("[extract q4] 161 s\n")  # still running: no `== exit`
    # bash's SECONDS ticks whole seconds: a poll of 1 s could end after its first round
    done = _poll(work, tmp_path / "dest", seconds=5)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("== hybrid: [extract q4] 161 s") == 1
    run_line = (
        "base-fp8-f1-s0: step 1000; last eval step 1000, tau 3.267, tau_walk 2.748, tau_walk_lookup 2.755"
    )
    assert done.stdout.count(run_line) >= 2
