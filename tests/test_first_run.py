"""What a new user meets (issue 31): progress on long steps, one definition of a cache's size, readable
`info` and `verify --dataset`, the dry run's layer choice explained, a no-op re-run said as such, and
prompt lookup on the tau plot."""

from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path

import pytest
from common.datasets import write_ones_stream
from common.fake_cache import write_fake_cache
from common.synth import make_cache
from common.train_cli import tiny_train_argv
from dflash.extract.result import ExtractResult, format_summary
from dflash.shards.cache import Cache
from dflash.shards.progress import ProgressLine
from dflash.shards.sizes import CacheSize
from dflash.shards.summary import cache_info
from dflash.tools import demo_steps
from dflash.tools.demo_steps import Steps, last_log_line
from dflash.tools.shards_cli import main as shards_main
from dflash.tools.shards_text import info_text
from dflash.train.cli import main as train_main
from dflash.train.metrics import tau_plot_series

from tests.common.extract import make_config, tiny_rows, write_dataset


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- progress ---------------------------------------------------------------------------------------


def test_progress_line_prints_every_interval_with_rate_and_eta() -> None:
    clock, out = FakeClock(), io.StringIO()
    progress = ProgressLine("train", 100, "step", every_s=10.0, stream=out, clock=clock)

    def steps(n: int) -> None:
        for _ in range(n):
            clock.now += 1.0  # one step a second
            progress.update(1)

    steps(9)
    progress.set_postfix(loss="0.52")
    assert out.getvalue() == ""  # under the interval, and a postfix alone prints nothing
    steps(1)
    assert out.getvalue() == "train 10/100 step (10%), 1.00 step/s, ETA 1:30, 0:10 elapsed, loss 0.52\n"
    steps(9)
    assert len(out.getvalue().splitlines()) == 1
    steps(1)
    assert (
        out.getvalue().splitlines()[1]
        == "train 20/100 step (20%), 1.00 step/s, ETA 1:20, 0:20 elapsed, loss 0.52"
    )
    clock.now += 1
    progress.update(3)
    progress.close()  # the totals once more, at the end
    assert (
        out.getvalue().splitlines()[2]
        == "train 23/100 step (23%), 1.10 step/s, ETA 1:10, 0:21 elapsed, loss 0.52"
    )
    progress.close()
    assert len(out.getvalue().splitlines()) == 3
    done = ProgressLine("train", 10, "step", every_s=1.0, stream=out, clock=clock)
    clock.now += 1
    done.update(10)
    done.close()  # the last line already showed the totals: not repeated
    assert out.getvalue().splitlines()[3:] == [
        "train 10/10 step (100%), 10.00 step/s, ETA 0:00, 0:01 elapsed"
    ]
    trainer = ProgressLine("train", 100, "step", every_s=1.0, stream=out, clock=clock)
    trainer.set_postfix({"loss": "0.5", "eta": "0:40"})  # training's own estimate replaces the line's
    clock.now += 2
    trainer.update(10)
    assert (
        out.getvalue().splitlines()[-1]
        == "train 10/100 step (10%), 5.00 step/s, 0:02 elapsed, loss 0.5, eta 0:40"
    )


def test_progress_lines_thin_out_over_a_long_run_to_one_a_minute() -> None:
    clock, out = FakeClock(), io.StringIO()
    progress = ProgressLine("train", None, "step", every_s=5.0, stream=out, clock=clock)

    def lines_during(seconds: int) -> int:
        before = len(out.getvalue().splitlines())
        for _ in range(seconds):
            clock.now += 1.0
            progress.update(1)
        return len(out.getvalue().splitlines()) - before

    assert lines_during(300) == 60  # the first minutes: every 5 s
    assert 200 < lines_during(3600) < 250  # the next hour: gaps of 1% of the elapsed time, 5 s to 39 s
    assert 1440 < lines_during(86400) < 1460  # the first day's rest: soon a line a minute
    assert lines_during(3600) == 60  # and a minute stays the gap, however long the run
    assert progress.interval() == 60.0


def test_progress_line_is_silent_for_quick_work_and_goes_to_the_current_stderr(monkeypatch) -> None:
    clock = FakeClock()
    progress = ProgressLine("generate", 10, "prompt", every_s=5.0, clock=clock)
    redirected = io.StringIO()
    monkeypatch.setattr(sys, "stderr", redirected)  # redirected after construction, as the demo does
    progress.update(10)
    progress.close()
    assert redirected.getvalue() == ""  # done inside the interval: no line at all
    slow = ProgressLine("generate", None, "prompt", every_s=5.0, clock=clock)
    clock.now += 6
    slow.update(3)
    assert redirected.getvalue() == "generate 3 prompt, 0.50 prompt/s, 0:06 elapsed\n"


def test_the_demo_heartbeat_repeats_a_steps_latest_progress(tmp_path: Path) -> None:
    console = io.StringIO()
    steps = Steps(tmp_path, verbose=False, heartbeat_s=0.05, console=console)

    def slow_step() -> int:
        print("train 3/10 step (30%), 1.00 step/s, ETA 0:07", file=sys.stderr)
        time.sleep(0.4)
        return 7

    assert steps.run("train", slow_step, lambda n: f"{n} steps") == 7
    lines = console.getvalue().splitlines()
    # On a loaded box a beat can come before the step's first line (nothing to repeat: "running" alone) or
    # between its last line and the step's end (it repeats that line).
    beats = [line for line in lines if "running" in line]
    progress = [b for b in beats if b.endswith(": train 3/10 step (30%), 1.00 step/s, ETA 0:07")]
    assert len(progress) >= 2, lines
    assert all(b in progress or b.endswith((" s", ": 7 steps")) for b in beats), beats
    assert lines[-1].startswith("[   train] 7 steps (")
    assert demo_steps.HEARTBEAT_S < 10  # the demo's promise: a line at least every 10 s
    log = (tmp_path / "logs" / "train.log").read_text()
    assert log.splitlines() == ["train 3/10 step (30%), 1.00 step/s, ETA 0:07", "7 steps"]
    assert last_log_line(tmp_path / "logs" / "train.log") == "7 steps"


def test_last_log_line_reads_tqdm_carriage_returns(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("start\nextract:  10%| 19/192\rextract:  50%| 96/192\r")
    assert last_log_line(log) == "extract:  50%| 96/192"
    assert last_log_line(tmp_path / "missing.log") == ""


# --- sizes, info, verify, re-run -------------------------------------------------------------------


def test_info_text_is_one_labelled_line_per_fact() -> None:
    d = {
        "path": "cache",
        "complete": True,
        "samples": 190,
        "skipped": 2,
        "shards": 1,
        "tokens": 8347,
        "supervised": 4224,
        "bytes": 1_800_000,
        "raw_bytes": 2_136_832,
        "raw_dtype": "float32",
        "bytes_per_token": 215.6,
        "layers": [0, 1],
        "hidden_size": 32,
        "dtype": "float32",
        "codec": {"name": "lossless", "level": 1},
        "target": {"name_or_path": "demo/target", "model_type": "qwen3", "num_hidden_layers": 2},
        "dataset": {
            "form": "save_to_disk",
            "rows": 192,
            "columns": {"input_ids": "input_ids", "loss_mask": "mask", "seq_len": "seq_len"},
            "schema": "input_ids: list<item: int32>\n  child 0, item: int32",
            "lengths_sha256": "0d8ee5d24815030df76daaeac257ec917b6d645e12807393342c19dde68177ca",
            "tokens_xxh3": "4cbb761e210bd44759573e4585bff294",
            "files": [{"name": "data-00000-of-00001.arrow", "bytes": 45040}],
        },
    }
    assert info_text(d) == "\n".join(
        [
            "cache       cache (complete)",
            "samples     190 (2 skipped) in 1 shards",
            "tokens      8,347 (4,224 supervised)",
            "size        1.7 MiB stored, 2.0 MiB raw float32 states, ratio 1.19x, 216 B/token",
            "layers      0, 1 (2 x hidden 32, float32)",
            "codec       lossless (level 1)",
            "target      demo/target (qwen3, 2 layers)",
            "dataset     save_to_disk, 192 rows, columns input_ids, loss_mask=mask, seq_len, 1 file, 44.0 KiB",
            "            lengths_sha256 0d8ee5d24815, tokens_xxh3 4cbb761e210b",
        ]
    )


def test_a_float32_caches_ratio_is_against_float32_states(tmp_path: Path, capsys) -> None:
    """The issue's demo cache is float32: `info` compared it with bf16 states (ratio 0.587x) while
    extraction compared with float32 (1.17x)."""
    import torch

    make_cache(tmp_path / "c", [40, 50, 60], layers=(0, 1), hidden=64, dtype=torch.float32)
    with Cache.open(tmp_path / "c") as cache:
        d = cache_info(cache)
    assert d["raw_dtype"] == "float32" and d["raw_bytes"] == 150 * 2 * 64 * 4
    assert d["ratio"] == pytest.approx(d["raw_bytes"] / d["bytes"]) and d["ratio"] > 1
    assert shards_main(["info", str(tmp_path / "c")]) == 0
    assert CacheSize(d["bytes"], d["raw_bytes"], "float32").text() in capsys.readouterr().out


def test_convert_prints_both_caches_by_the_one_definition(tmp_path: Path, capsys) -> None:
    import torch

    make_cache(tmp_path / "c", [40, 50, 60], layers=(0, 1), hidden=64, dtype=torch.float32)
    assert shards_main(["convert", str(tmp_path / "c"), "--codec", "q4", "--out", str(tmp_path / "q4")]) == 0
    printed = capsys.readouterr().out
    sizes = {}
    for name in ("c", "q4"):
        with Cache.open(tmp_path / name) as cache:
            d = cache_info(cache)
        sizes[name] = CacheSize(d["bytes"], d["raw_bytes"], d["raw_dtype"])
    assert sizes["q4"].dtype == "bfloat16"  # q4 decodes to bf16: its raw states are bf16
    assert f"{sizes['c'].text()} -> {sizes['q4'].text()}" in printed
    fewer = sizes["c"].stored_bytes / sizes["q4"].stored_bytes
    assert f"{fewer:.2f}x fewer stored bytes than the source" in printed


@pytest.fixture(scope="module")
def extracted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from dflash.extract.pipeline import run_extraction

    from tests.common.targets import make_target

    root = tmp_path_factory.mktemp("first_run")
    target = make_target(root, "qwen3")
    dataset = write_dataset(root, tiny_rows(24))
    config = make_config(target, dataset, root / "cache")
    return {"config": config, "dataset": dataset, "first": run_extraction(config)}


def test_extractions_size_is_infos(extracted: dict) -> None:
    first: ExtractResult = extracted["first"]
    with Cache.open(extracted["config"].out) as cache:
        d = cache_info(cache)
    assert first.raw_dtype == d["raw_dtype"] == "float32"
    assert (first.bytes_written, first.raw_bytes) == (d["bytes"], d["raw_bytes"])
    assert first.size.text() in format_summary(first)


def test_a_complete_cache_rerun_says_nothing_to_do(extracted: dict, capsys) -> None:
    from dflash.extract.pipeline import run_extraction

    capsys.readouterr()
    again = run_extraction(extracted["config"])
    out = capsys.readouterr().out
    assert again.already_complete and again.units_done == 0
    assert out.strip() == (
        f"cache {again.cache}: complete, nothing to do ({again.units_total} of {again.units_total} units "
        f"committed before); check it with `dflash-shards verify {again.cache}`"
    )
    assert "tokens/s" not in out and "stage" not in out


def test_verify_with_the_dataset_says_what_it_accounted_for(extracted: dict, capsys) -> None:
    cache = str(extracted["config"].out)
    assert shards_main(["verify", cache, "--dataset", str(extracted["dataset"])]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("OK: ")
    assert lines[1] == (
        "dataset: 24 rows accounted for: 21 stored once, 3 listed as skipped, 0 missing; row count, "
        "row lengths, token ids and loss masks match the manifest's"
    )
    assert shards_main(["verify", cache]) == 0
    assert "dataset" not in capsys.readouterr().out  # without --dataset nothing is claimed
    assert shards_main(["verify", cache, "--dataset", str(extracted["dataset"]), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dataset"]["stored"] == 21 and report["dataset"]["fingerprint_matches"] is True


def test_verify_text_with_an_older_manifests_fingerprint(tmp_path: Path, capsys) -> None:
    """A manifest that records only the dataset's row count: the line says what was compared."""
    make_cache(tmp_path / "c", [4, 5, 6], rows_per_shard=2, skipped=((3, "empty"),))
    ds = write_ones_stream(tmp_path / "ds", [4, 5, 6, 0])
    assert shards_main(["verify", str(tmp_path / "c"), "--dataset", str(ds)]) == 1  # 4 rows, manifest 3
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == (
        "dataset: 4 rows accounted for: 3 stored once, 1 listed as skipped, 0 missing; row count does NOT "
        "match the manifest's"
    )


# --- training ----------------------------------------------------------------------------------------


def test_the_dry_run_says_why_it_picked_its_layers(tmp_path: Path, capsys) -> None:
    cache = write_fake_cache(tmp_path / "cache", num_samples=16, samples_per_shard=8)  # a 4-layer target
    argv = tiny_train_argv(cache, tmp_path / "run", "--num-draft-layers", "5", "--dry-run")
    assert train_main(argv) == 0
    plan = capsys.readouterr().out.splitlines()
    features = next(line for line in plan if line.startswith("features"))
    # The recipe's numbers a user compares with another run's (the demo's): anchors, block, lr.
    assert "block 4, 8 anchors," in next(line for line in plan if line.startswith("drafter"))
    assert next(line for line in plan if line.startswith("schedule")).endswith(", lr 0.001")
    assert features == (
        "features    target layers [1, 1, 1, 1, 1]: the DFlash default rule for 5 draft layers on a 4-layer "
        "target (fewer than 5 + 3 layers: ids repeat); the cache also holds [0, 2, 3], unread: pass "
        "--target-layer-ids 0,1,2,3 to feed every cached layer"
    )
    assert train_main([*argv, "--target-layer-ids", "0,2"]) == 0
    assert "target layers [0, 2]: as given (--target-layer-ids)" in capsys.readouterr().out


def test_the_tau_plot_draws_prompt_lookup() -> None:
    history = [
        {"step": 0, "tau": 1.0, "tau_walk": 1.0, "tau_walk_lookup": 1.3},
        {"step": 10, "loss": 2.0},
        {"step": 20, "tau": 3.1, "tau_walk": 2.9, "tau_walk_lookup": 1.3},
    ]
    lines = tau_plot_series(history)
    assert lines["prompt lookup (decode walk)"] == ([0, 20], [1.3, 1.3])
    assert lines["tau (decode walk)"] == ([0, 20], [1.0, 2.9])


def test_the_dry_runs_estimate_counts_float32_states(extracted: dict) -> None:
    """The demo extracts in float32 on the CPU: the dry run estimated lossless from bf16 states (14.7 MiB
    for a 34.7 MiB cache); it now plans in the dtype the run computes in."""
    from dflash.extract.dryrun import dry_run_summary
    from dflash.extract.prepare import prepare

    config = extracted["config"]
    summary = dry_run_summary(config, prepare(config))
    first: ExtractResult = extracted["first"]
    assert summary["dtype"] == "float32"
    assert summary["bytes_estimate"]["raw"] >= first.raw_bytes  # tokens x layers x hidden x 4, plus frames
    assert summary["bytes_estimate"]["lossless"] == pytest.approx(first.bytes_written, rel=0.05)
    assert "float32 states uncompressed" in summary["codecs"]["raw"]["tau"]
