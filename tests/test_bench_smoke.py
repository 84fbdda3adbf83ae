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
    "gil": [
        "bench/bench_gil.py",
        "--tokens",
        "64",
        "--hidden",
        "256",
        "--seconds",
        "0.05",
        "--rounds",
        "1",
        "--encode-threads",
        "2",
    ],
    "compile": ["bench/bench_compile.py", "--backend", "aot_eager"],
    "verify": ["bench/bench_verify.py", "--tiny"],
    "layer_delta": ["bench/bench_layer_delta.py", "--tiny", "--rows", "3"],
    "q_ops": ["bench/bench_q_ops.py", "--cpu-seconds", "--rounds", "1"],
    # a codec named twice runs twice (the order check); --profile prints the last run's top ops
    "extract": [
        "bench/bench_extract.py",
        "--tiny",
        "--device",
        "cpu",
        "--codec",
        "fp8,lossless,fp8",
        "--profile",
    ],
    "train_step": ["bench/bench_train_step.py", "--tiny", "--device", "cpu", "--sections", "step,small"],
    "train": [
        "bench/bench_train.py",
        "--tiny",
        "--device",
        "cpu",
        "--codecs",
        "fp8",
        "--threads-sweep",
        "1",
        "--draft-layers",
        "3",
    ],
    # moto's server, an upload, training by range reads and from kept shards (the H200's data-wait call)
    "data_wait": [
        "bench/bench_data_wait.py",
        "--shape",
        "tiny",
        "--device",
        "cpu",
        "--codecs",
        "fp8",
        "--sources",
        "s3,s3+disk",
        "--samples",
        "24",
        "--train-seconds",
        "1",
        "--loader-seconds",
        "0.5",
        "--server-seconds",
        "0.3",
        "--train-threads",
        "1",
    ],
    # moto's server, every installed range-read client beside the loop (the GIL bench)
    "s3_gil": [
        "bench/bench_s3_gil.py",
        "--range-kb",
        "4",
        "--object-mb",
        "1",
        "--seconds",
        "0.1",
        "--rounds",
        "1",
        "--rate",
        "40",
        "--loop",
        "launcher",
    ],
    "tiles": ["bench/bench_tiles.py", "--repeat", "1"],
    "loader_end": ["bench/bench_loader_end.py", "--workers", "0,1", "--passes", "1", "--samples", "40"],
    "spy_summary_imports": ["bench/spy_summary.py", "--help"],
    "attention_imports": ["bench/bench_attention.py", "--help"],
    "target_ops": ["bench/target_ops.py", "--size", "ci"],
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


def test_train_bench_recipe_flags_win_over_the_shapes_defaults() -> None:
    # --draft-layers / --feature-layers measure what depth and features cost the loop (BENCHMARKS.md): they
    # must reach both the trainer's config and the drafter the FLOP count is made for, over --small's 3.
    import torch

    from bench import bench_train
    from bench.shapes import SMALL

    cpu = torch.device("cpu")
    common = dict(shape="small", device=cpu, budget=512, max_len=450, threads=1, compile=False)
    cfg, drafter = bench_train.train_config("C", "O", SMALL, **common)
    assert cfg.drafter.num_draft_layers == drafter.num_hidden_layers == 3
    cfg, drafter = bench_train.train_config(
        "C", "O", SMALL, num_draft_layers=5, target_layer_ids="1,3,5,7,9", **common
    )
    assert cfg.drafter.num_draft_layers == drafter.num_hidden_layers == 5
    assert cfg.drafter.target_layer_ids == tuple(drafter.target_layer_ids) == (1, 3, 5, 7, 9)


def test_batch_excess_sets_each_batch_beside_its_bare_forward() -> None:
    """Batches pair by their token counts, whatever order the pipeline ran them in; a spike in one batch shows
    in the total and the p90, not in the median."""
    from bench.extract_common import batch_excess

    bare = {100: 10.0, 200: 20.0, 300: 30.0, 400: 40.0, 500: 50.0}
    run = [
        (500, 50.5, 60.0),
        (100, 10.5, 12.0),
        (300, 80.0, 31.0),
        (200, 20.5, 25.0),
        (400, 40.5, 41.0),
        (7, 1.0, 1.0),
    ]
    got = batch_excess(run, bare)
    assert got["batches"] == 5  # the batch of 7 tokens has no bare twin
    assert got["excess_ms_total"] == pytest.approx(52.0)
    assert got["excess_ms_median"] == pytest.approx(0.5)
    assert got["excess_ms_p90"] == pytest.approx(50.0)
    assert got["excess_ms_first3"] == [0.5, 0.5, 50.0]
    assert got["host_ms_median"] == pytest.approx(31.0)
    assert batch_excess([], bare) == {}


def test_extract_result_keeps_batch_times_out_of_json() -> None:
    from dflash.extract.result import ExtractResult

    r = ExtractResult(cache="c", complete=True, batch_times=[(1, 2.0, 3.0)] * 5000)
    assert "batch_times" not in r.to_dict() and len(r.batch_times) == 5000


def test_allocator_counters_are_deltas_of_the_run() -> None:
    """The extraction bench reports what each codec's run added to the allocators' counters (a cudaFree, a
    pinned-pool growth inside a run is a suspect for that run's slow batches); off CUDA there are none."""
    import torch

    from bench.extract_common import allocator_counters, counters_delta

    before = {"num_device_free": 3.0, "host.num_host_alloc": 10.0, "only_before": 1.0}
    after = {"num_device_free": 5.0, "host.num_host_alloc": 10.0, "only_after": 2.0}
    assert counters_delta(before, after) == {"num_device_free": 2.0, "host.num_host_alloc": 0.0}
    assert allocator_counters(torch.device("cpu")) == {}
