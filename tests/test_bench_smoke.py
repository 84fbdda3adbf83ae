"""Every benchmark script still runs against the code it measures (tiny sizes, CPU).

Benchmarks run on a GPU machine whose time is rationed; one that broke after a contract change (the writer's
channel items, CACHE/target/ becoming required, a moved function) costs a whole call there. These runs take
seconds here. `bench_quality.py` has its own test; the scaling bench's tiny run takes a minute, so only its
imports are checked.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

RUNS = {
    "writer": ["bench/bench_writer.py", "--gb", "0.02", "--unit-mb", "8", "--sample-mb", "2"],
    "convert": ["bench/bench_convert.py", "--tiny"],
    "codecs": ["bench/bench_codecs.py", "--quick"],
    "compile": ["bench/bench_compile.py", "--backend", "aot_eager"],
    "verify": ["bench/bench_verify.py", "--tiny"],
    "extract": ["bench/bench_extract.py", "--tiny", "--device", "cpu"],
    "train_step": ["bench/bench_train_step.py", "--tiny", "--device", "cpu", "--sections", "step,small"],
    "train": ["bench/bench_train.py", "--tiny", "--device", "cpu", "--codecs", "fp8", "--threads-sweep", "1"],
    "scaling_imports": ["bench/bench_scaling.py", "--help"],
    "forward_imports": ["bench/bench_forward.py", "--help"],
    "dataset_imports": ["bench/bench_dataset.py", "--help"],
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_benchmark_runs(name: str, tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, *RUNS[name]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
    assert done.returncode == 0, f"{' '.join(RUNS[name])} failed:\n{tail}"
    assert "Traceback" not in done.stderr, tail
