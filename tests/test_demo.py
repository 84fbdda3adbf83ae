"""`dflash-demo`: the reduced demo runs end to end, is deterministic, and guards its output directory."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from dflash.tools import demo
from dflash.train.export import load_drafter
from dflash.train.metrics import read_metrics

PATH_KEYS = ("target", "dataset", "cache", "run", "export", "chats", "plots")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("demo") / "out"
    assert demo.main(["--out", str(out), "--quick"]) == 0
    return out, json.loads((out / demo.SUMMARY_NAME).read_text())


def test_quick_demo_summary_paths_and_export(quick_run) -> None:
    out, summary = quick_run
    assert {"tau_before", "tau_after", "timings", *PATH_KEYS} <= set(summary)
    for key in PATH_KEYS:
        assert Path(summary[key]).exists(), key
        assert out.resolve() in Path(summary[key]).parents, key
    # The steps' own chatter went to the logs, not the console.
    assert "complete" in (out / "logs" / "extract.log").read_text()
    assert (Path(summary["target"]) / "config.json").is_file()  # the target's full HF dir is kept
    assert (Path(summary["dataset"]) / "dataset_info.json").is_file()
    assert (Path(summary["cache"]) / "manifest.json").is_file()
    assert set(summary["timings"]) == {"target", "data", "tokenize", "extract", "before", "train", "after"}
    assert all(t["seconds"] >= 0 and t["cpu_seconds"] >= 0 for t in summary["timings"].values())
    assert {Path(p).name for p in summary["plot_files"]} >= {"loss.png", "tau.png"}
    drafter = load_drafter(summary["export"])
    spec = demo.DEMO_SIZES["quick"]
    assert drafter.config.block_size == spec.block_size
    assert drafter.config.num_hidden_layers == spec.num_draft_layers
    assert drafter.config.mask_token_id == summary["target_info"]["tokenizer_len"]
    assert summary["train_steps"] == spec.train_steps
    # The untrained drafter guesses nothing; the trained one clearly does (held-out rows).
    assert summary["tau_before"] < 1.2
    assert summary["tau_after"] > summary["tau_before"] + 1.0
    assert summary["tau_walk_after"] > summary["tau_walk_before"]
    evals = [r for r in read_metrics(summary["run"]) if "tau" in r]
    assert evals[0]["step"] == 0 and evals[0]["tau"] == summary["tau_before"]  # the plots start untrained
    assert evals[-1]["step"] == spec.train_steps


def test_demo_is_deterministic(quick_run, tmp_path) -> None:
    _, first = quick_run
    demo.run_demo(demo.DemoConfig(out=str(tmp_path / "again"), size="quick"))
    second = json.loads((tmp_path / "again" / demo.SUMMARY_NAME).read_text())
    for key in ("tau_before", "tau_after", "tau_walk_before", "tau_walk_after"):
        assert second[key] == first[key], key
    untimed = [
        {k: v for k, v in run["eval_after"].items() if not k.endswith("_seconds")} for run in (first, second)
    ]
    assert untimed[1] == untimed[0] and "tau_walk" in untimed[0]  # wall times differ, the metrics may not


def test_refuses_a_non_empty_out_unless_it_is_an_earlier_demo(tmp_path, capsys) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert demo.main(["--out", str(foreign), "--quick"]) == 2
    assert "not empty" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not written by dflash-demo"):
        demo.DemoConfig(out=str(foreign), overwrite=True)
    assert (foreign / "notes.txt").read_text() == "keep me"
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / demo.MARKER).write_text("")
    demo.DemoConfig(out=str(earlier), overwrite=True)  # accepted: run_demo would replace it
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        demo.DemoConfig(out=str(tmp_path / "file"))


def test_bad_settings_are_one_line_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown demo size"):
        demo.DemoConfig(out=str(tmp_path / "x"), size="huge")
    with pytest.raises(ValueError, match="threads"):
        demo.DemoConfig(out=str(tmp_path / "x"), threads=0)
    quick = demo.DEMO_SIZES["quick"]
    with pytest.raises(ValueError, match="token_budget 8 must be >= max_length"):
        dataclasses.replace(quick, token_budget=8)
    with pytest.raises(ValueError, match="eval_fraction"):
        dataclasses.replace(quick, eval_fraction=0.0)
    with pytest.raises(ValueError, match="train_steps"):
        dataclasses.replace(quick, train_steps=0)
