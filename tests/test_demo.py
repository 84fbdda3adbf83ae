"""`dflash-demo`: the reduced demo runs end to end, is deterministic, and guards its output directory."""

from __future__ import annotations

import contextlib
import dataclasses
import io
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
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        assert demo.main(["--out", str(out), "--quick"]) == 0
    (out.parent / "console.txt").write_text(console.getvalue())
    return out, json.loads((out / demo.SUMMARY_NAME).read_text())


def _console(out: Path) -> str:
    return (out.parent / "console.txt").read_text()


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
    # dflash-train's end-of-run reading, from the same records: the best walk is the exported step's
    assert summary["verdict"][0].startswith(
        f"drafter: held-out decode walk {summary['tau_walk_best_in_training']:.3f}"
    )
    printed = [line for line in _console(out).splitlines() if line.startswith("schedule: ")]
    assert printed == summary["verdict"][1:]  # here none: the walk rose 0.3% over the last 60 of 120 steps


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


def test_every_step_logs_its_output(quick_run) -> None:
    """Issue 31: train.log and target.log stayed empty; each log now holds the step's own output and ends
    with the line the console showed."""
    out, summary = quick_run
    console = _console(out)
    for step in summary["timings"]:
        log = (out / "logs" / f"{step}.log").read_text()
        assert log.strip(), step
        last = log.strip().splitlines()[-1]
        assert f"[{step:>8}] {last} (" in console, step
    train_log = (out / "logs" / "train.log").read_text()
    assert train_log.startswith("dflash-train: ")  # the trainer's own plan line, as the CLI prints it


def test_the_printed_commands_build_the_demos_configs(quick_run) -> None:
    """The commands in summary.json (and on the console) are the ones the demo ran: parsing them with
    the CLIs' own parsers gives the configs the steps used."""
    import shlex

    from dflash.extract.cli import config_from_args as extract_config
    from dflash.shards.cache import Cache
    from dflash.shards.summary import cache_size
    from dflash.tools.demo_eval import make_train_config
    from dflash.train.cli import build_config

    out, summary = quick_run
    commands = summary["commands"]
    assert set(commands) == {"tokenize", "extract", "train"}
    argvs = {}
    for name, line in commands.items():
        words = shlex.split(line)
        assert words[:2] == ["OMP_NUM_THREADS=1", f"dflash-{name}"] and line in _console(out)
        argvs[name] = words[2:]
    spec = demo.DEMO_SIZES["quick"]
    cfg = build_config(argvs["train"])
    assert cfg == make_train_config(Path(summary["cache"]), Path(summary["run"]), spec, seed=0)
    assert (cfg.drafter.num_draft_layers, cfg.drafter.block_size) == (spec.num_draft_layers, spec.block_size)
    assert (cfg.optim.lr, cfg.optim.max_steps) == (spec.lr, spec.train_steps)
    with Cache.open(summary["cache"]) as cache:
        assert list(cfg.drafter.target_layer_ids) == list(cache.layers)
        size = cache_size(cache)
    extract = extract_config(argvs["extract"])
    assert (extract.layers, extract.codec, extract.dtype) == ("all", "lossless", "float32")
    # The demo's size figure is the cache's, by the definition `dflash-shards info` uses.
    assert f"lossless: {size.text()} -> " in _console(out)
    assert summary["extract"]["raw_dtype"] == "float32" and summary["extract"]["ratio"] == size.ratio


def test_the_best_and_exported_walks_are_explained(quick_run) -> None:
    """Training's best decode walk is the best step's fp32 weights; the export holds them in bf16. Evaluated
    in fp32, the export's step gives training's number exactly; the console says why the two differ."""
    import torch
    from dflash.tools.demo_eval import evaluate_drafter, make_train_config
    from dflash.train import checkpoint as ckpt
    from dflash.train.model import DFlashDrafter

    out, summary = quick_run
    cfg = make_train_config(Path(summary["cache"]), out / "unused", demo.DEMO_SIZES["quick"], seed=0)
    exported = load_drafter(summary["export"], dtype=torch.float32)
    fp32 = DFlashDrafter(exported.config)
    ckpt.load_weights(fp32, ckpt.find_checkpoint(summary["run"], best=True) / "model.safetensors")
    assert evaluate_drafter(fp32, cfg)["tau_walk"] == summary["tau_walk_best_in_training"]
    after = next(line for line in _console(out).splitlines() if line.startswith("[   after]"))
    if summary["tau_walk_after"] != summary["tau_walk_best_in_training"]:
        assert f"training measured {summary['tau_walk_best_in_training']:.3f}" in after and "bf16" in after
    else:
        assert "training measured" not in after
