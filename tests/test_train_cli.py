"""`dflash-train` flags, config files, presets, one-line errors, and `dflash-train export`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from dflash.train import cli
from dflash.train.config import TrainConfig, config_from_flat, paper_recipe
from dflash.train.export import load_drafter
from dflash.train.metrics import read_metrics

from tests.common.fake_cache import corrupt_sample, write_fake_cache
from tests.common.train_cli import tiny_train_argv


def test_paper_recipe_defaults() -> None:
    cfg = paper_recipe("c", "o")
    assert (cfg.optim.lr, cfg.optim.warmup_frac, cfg.optim.grad_clip, cfg.optim.epochs) == (
        6e-4,
        0.04,
        1.0,
        6,
    )
    assert (cfg.drafter.num_draft_layers, cfg.drafter.block_size, cfg.drafter.num_anchors) == (5, 16, 512)
    assert cfg.drafter.loss_gamma == 7.0 and cfg.data.max_length == 3072 and cfg.data.on_corrupt == "fail"
    assert config_from_flat(cfg.to_flat()) == cfg  # flat round trip (what meta.json stores)


def test_the_default_is_the_paper_recipe_with_reach_weights_and_preset_paper_is_the_paper(capsys) -> None:
    default = cli.build_config(["--cache", "C", "--out", "O"])
    paper = cli.build_config(["--cache", "C", "--out", "O", "--preset", "paper"])
    assert (default.drafter.slot_weights, paper.drafter.slot_weights) == ("reach", "decay")
    assert (default.drafter.loss_gamma, paper.drafter.loss_gamma) == (1.0, 7.0)  # reach's floor; the paper's
    # the length: the paper's 6 epochs; the default's is set from the cache's size (`schedule.default_epochs`)
    assert (default.optim.epochs, paper.optim.epochs) == (None, 6)
    # nothing else differs: the default keeps the paper's shape and optimizer
    differ = {k for k, v in default.to_flat().items() if paper.to_flat()[k] != v}
    assert differ == {"slot_weights", "epochs", "early_stop"}  # the paper trains its whole schedule
    assert (default.early_stop, paper.early_stop) == (0.02, 0.0)
    paper_as_default = ["--preset", "paper", "--slot-weights", "reach", "--early-stop", "0.02"]
    assert cli.build_config(["--cache", "C", "--out", "O", *paper_as_default, "--epochs", "6"]) == (
        cli.build_config(["--cache", "C", "--out", "O", "--epochs", "6"])
    )
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "(default: reach; --preset paper: decay; --preset tiny:" not in shown  # tiny follows the default
    assert "(default: reach; --preset paper: decay)" in shown


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_config_file_keys_mirror_flags_and_flags_win(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"run{suffix}"
    if suffix == ".json":
        path.write_text(
            json.dumps(
                {
                    "cache": "C",
                    "out": "O",
                    "token-budget": 4096,
                    "max_length": 2048,
                    "lr": 1e-3,
                    "target_layer_ids": [1, 2],
                }
            )
        )
    else:
        path.write_text(
            'cache = "C"\nout = "O"\ntoken-budget = 4096\nmax_length = 2048\nlr = 1e-3\n'
            "target_layer_ids = [1, 2]\n"
        )
    cfg = cli.build_config(["--config", str(path), "--lr", "2e-4", "--target-layer-ids", "3,5"])
    assert isinstance(cfg, TrainConfig)
    assert (cfg.cache, cfg.out, cfg.data.token_budget, cfg.data.max_length) == ("C", "O", 4096, 2048)
    assert cfg.optim.lr == 2e-4 and cfg.drafter.target_layer_ids == (3, 5)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cache", "C"], "out is required"),
        (["--cache", "C", "--out", "O", "--lr", "-1"], "lr=-1.0: must be a positive number"),
        (["--cache", "C", "--out", "O", "--token-budget", "100", "--max-length", "200"], "token_budget=100"),
        (["--cache", "C", "--out", "O", "--target-layer-ids", "1,x"], "target_layer_ids='1,x'"),
        (["--cache", "C", "--out", "O", "--eval-fraction", "1.5"], "eval_fraction=1.5"),
        (["--cache", "C", "--out", "O", "--copy-anchor-weight", "0.5"], "copy_anchor_weight=0.5: must be"),
        (["--cache", "C", "--out", "O", "--copy-slot-weight", "-1"], "copy_slot_weight=-1.0: must be"),
        (["--cache", "C", "--out", "O", "--copy-slot-weight", "nan"], "copy_slot_weight=nan: must be"),
        (["--cache", "C", "--out", "O", "--early-stop", "1"], "early_stop=1.0: must be in [0, 1)"),
        (["--cache", "C", "--out", "O", "--early-stop", "nan"], "early_stop=nan: must be in [0, 1)"),
        (["--cache", "/nonexistent/cache", "--out", "O"], "no manifest"),
        (["--cache", "C", "--out", "O", "--device", "cpu", "--attention", "flex"], "needs a CUDA device"),
    ],
)
def test_bad_settings_are_one_line_errors(argv: list[str], message: str, capsys, tmp_path: Path) -> None:
    argv = [a if a != "O" else str(tmp_path / "o") for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dflash-train: error:") and message in err and "\n" not in err


def test_a_config_files_preset_must_be_one_of_the_presets(tmp_path: Path, capsys) -> None:
    for preset in ("fast", ["tiny"]):
        path = tmp_path / "c.json"
        path.write_text(json.dumps({"cache": "C", "out": str(tmp_path / "o"), "preset": preset}))
        assert cli.main(["--config", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert "preset=" in err and "choose one of default, paper, tiny" in err and "\n" not in err


def test_unknown_config_key(tmp_path: Path, capsys) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"cache": "C", "out": "O", "learning_rate": 1}))
    assert cli.main(["--config", str(path)]) == 2
    assert "unknown config key 'learning_rate'" in capsys.readouterr().err


def test_train_then_export_any_checkpoint(tmp_path: Path, capsys) -> None:
    cache = write_fake_cache(tmp_path / "cache", num_samples=30, samples_per_shard=10)
    run = tmp_path / "run"
    argv = tiny_train_argv(
        cache,
        run,
        "--max-steps",
        "4",
        "--save-every",
        "2",
        "--eval-every",
        "2",
        "--no-tensorboard",
        "--no-plots",
        "--target-layer-ids",
        "1,3",
        "--num-draft-layers",
        "2",
    )
    assert cli.main(argv) == 0
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    walks = [r["tau_walk"] for r in read_metrics(run) if "tau_walk" in r]
    said = capsys.readouterr().out  # the end-of-run verdict: the best of the two evaluations' walks
    assert len(walks) == 2 and f"drafter: held-out decode walk {max(walks):.3f} at step " in said, said
    assert "x prompt lookup's " in said
    assert cli.main(["export", str(run), "--out", str(tmp_path / "e2"), "--step", "2"]) == 0
    assert cli.main(["export", str(run), "--out", str(tmp_path / "best"), "--best"]) == 0
    assert cli.main(["export", str(run), "--out", str(tmp_path / "latest")]) == 0
    drafter = load_drafter(tmp_path / "e2")
    assert drafter.config.target_layer_ids == (1, 3) and drafter.config.num_hidden_layers == 2
    assert cli.main(["export", str(run), "--out", str(tmp_path / "e9"), "--step", "9"]) == 2
    assert "no checkpoint for step 9" in capsys.readouterr().err


def test_distill_trains_from_the_cached_last_layer_or_says_what_it_lacks(tmp_path: Path, capsys) -> None:
    from safetensors.torch import load_file, save_file

    from tests.common.hostile import record_target_files

    cache = write_fake_cache(tmp_path / "cache", num_samples=20, samples_per_shard=10)
    common = (
        "--max-steps",
        "2",
        "--eval-every",
        "0",
        "--no-tensorboard",
        "--no-plots",
        "--num-draft-layers",
        "1",
    )
    argv = tiny_train_argv(cache, tmp_path / "run", *common, "--distill", "0.5", "--target-layer-ids", "1,3")
    assert cli.main(argv) == 0
    assert all(np.isfinite(r["loss"]) for r in read_metrics(tmp_path / "run"))
    # The teacher (last) layer need not be a feature: it is read beside them.
    argv = tiny_train_argv(cache, tmp_path / "r2", *common, "--distill", "0.5", "--target-layer-ids", "1,2")
    assert cli.main([*argv, "--eval-every", "2"]) == 0
    assert any("tau" in r for r in read_metrics(tmp_path / "r2"))  # evaluation reads the features alone
    assert cli.main(["export", str(tmp_path / "r2"), "--out", str(tmp_path / "e2")]) == 0
    assert load_drafter(tmp_path / "e2").config.target_layer_ids == (1, 2)  # the teacher stays out
    small = write_fake_cache(tmp_path / "c3", num_samples=20, samples_per_shard=10, layers=(0, 1, 2))
    argv = tiny_train_argv(small, tmp_path / "r4", *common, "--distill", "0.5", "--target-layer-ids", "1,2")
    assert cli.main(argv) == 2
    assert "--distill needs the target's last layer (3) in the cache" in capsys.readouterr().err
    frozen = cache / "target" / "frozen.safetensors"  # a cache from before the gain was stored
    tensors = load_file(str(frozen))
    del tensors["final_norm.gain"]
    save_file(tensors, str(frozen))
    record_target_files(cache)
    argv = tiny_train_argv(cache, tmp_path / "r3", *common, "--distill", "1", "--target-layer-ids", "3")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "no final norm gain" in err and "re-run the same dflash-extract" in err and "\n" not in err


def test_corrupt_sample_is_skipped_and_reported_or_fails(tmp_path: Path, capsys) -> None:
    from dflash.shards import ShardReader
    from dflash.train.data_plan import heldout_mask

    cache = write_fake_cache(tmp_path / "cache", num_samples=30, samples_per_shard=10)
    with ShardReader.open(cache / "shards" / "shard-000000.dfs") as reader:
        index = next(i for i, e in enumerate(reader.entries) if not heldout_mask(np.array([e.row]), 0.2)[0])
    corrupt_sample(cache, "shard-000000.dfs", index, frame=4)  # layer 2: the tiny preset's default layer
    base = ["--preset", "tiny", "--cache", str(cache), "--no-tensorboard", "--no-plots", "--eval-every", "0"]
    assert cli.main([*base, "--out", str(tmp_path / "skip"), "--on-corrupt", "skip"]) == 0
    records = read_metrics(tmp_path / "skip")
    assert records[-1]["skipped_samples"] == 2  # once per epoch, never trained on
    capsys.readouterr()
    assert cli.main([*base, "--out", str(tmp_path / "fail")]) == 2
    err = capsys.readouterr().err.strip()
    assert "checksum mismatch" in err and "--on-corrupt skip" in err and "\n" not in err
