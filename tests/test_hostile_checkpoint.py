"""Damaged checkpoints of a `dflash-train` run directory: JSON of the wrong shape or with out-of-range fields,
truncated or bit-flipped safetensors. `--resume` and `export` end in one line naming the file (and field),
exit 2, and leave the run directory as it was; an intact or merely untidy run still resumes."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from common.fake_cache import write_fake_cache
from common.hostile import one_error_line, tree_snapshot
from common.train_cli import tiny_train_argv
from dflash.train import cli as train_cli

PROG = "dflash-train"
QUIET = ("--no-tensorboard", "--no-plots", "--no-progress", "--eval-every", "0")
LATEST = "checkpoints/step_000002"


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fake_cache(tmp_path_factory.mktemp("t") / "cache", num_samples=30, samples_per_shard=10)


@pytest.fixture(scope="module")
def template_run(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-step run with a checkpoint after each step."""
    out = tmp_path_factory.mktemp("run") / "run"
    argv = tiny_train_argv(cache, out, "--max-steps", "2", "--save-every", "1", "--keep-checkpoints", "5")
    assert train_cli.main([*argv, *QUIET]) == 0
    assert (out / LATEST / "meta.json").is_file()
    return out


@pytest.fixture
def run(template_run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(template_run, tmp_path / "run"))


def _resume_argv(cache: Path, run: Path) -> list[str]:
    return [*tiny_train_argv(cache, run, "--resume", "--max-steps", "3"), *QUIET]


def _edit_json(path: Path, edit: Callable[[object], object]) -> None:
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def _set(key: str, value: object, sub: str | None = None) -> Callable[[object], object]:
    def edit(d: object) -> object:
        assert isinstance(d, dict)
        (d[sub] if sub else d)[key] = value
        return d

    return edit


def _flip_tail(path: Path, n: int = 20) -> None:
    b = path.read_bytes()
    path.write_bytes(b[:-n] + bytes(x ^ 255 for x in b[-n:]))


# (file, damage, words the error line must hold besides the file's path)
DAMAGE = {
    "meta_null": ("meta.json", lambda p: p.write_text("null"), ["JSON object"]),
    "meta_step_negative": ("meta.json", lambda p: _edit_json(p, _set("step", -5)), ["step"]),
    "meta_step_huge": ("meta.json", lambda p: _edit_json(p, _set("step", 10**30)), ["step"]),
    "meta_step_string": ("meta.json", lambda p: _edit_json(p, _set("step", "x")), ["step"]),
    "meta_step_other_dir": ("meta.json", lambda p: _edit_json(p, _set("step", 1)), ["step", "step_000002"]),
    "meta_config_string": ("meta.json", lambda p: _edit_json(p, _set("config", "x")), ["config"]),
    "meta_best_walk_list": ("meta.json", lambda p: _edit_json(p, _set("best_walk", [1])), ["best_walk"]),
    "meta_best_walk_string": ("meta.json", lambda p: _edit_json(p, _set("best_walk", "x")), ["best_walk"]),
    "loader_list": ("loader.json", lambda p: p.write_text("[]"), ["JSON object"]),
    "loader_epoch_null": ("loader.json", lambda p: _edit_json(p, _set("epoch", None)), ["epoch"]),
    "loader_epoch_negative": ("loader.json", lambda p: _edit_json(p, _set("epoch", -5)), ["epoch"]),
    "loader_epoch_string": ("loader.json", lambda p: _edit_json(p, _set("epoch", "x")), ["epoch"]),
    "loader_epoch_huge": ("loader.json", lambda p: _edit_json(p, _set("epoch", 10**30)), ["epoch"]),
    "loader_epoch_past_run": ("loader.json", lambda p: _edit_json(p, _set("epoch", 5)), ["epoch"]),
    "rng_number": ("rng.json", lambda p: p.write_text("5"), ["JSON object"]),
    "rng_numpy_string": ("rng.json", lambda p: _edit_json(p, _set("numpy", "x")), ["numpy"]),
    "rng_kind_pcg64": ("rng.json", lambda p: _edit_json(p, _set("kind", "PCG64", "numpy")), ["numpy.kind"]),
    "optimizer_null": ("optimizer.json", lambda p: p.write_text("null"), ["JSON object"]),
    "optimizer_betas_string": (
        "optimizer.json",
        lambda p: _edit_json(p, lambda d: d["param_groups"][0].update(betas="x") or d),
        ["betas"],
    ),
    "model_truncated": ("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[:100]), ["safetensors"]),
    "model_empty": ("model.safetensors", lambda p: p.write_bytes(b""), ["safetensors"]),
    "optimizer_truncated": (
        "optimizer.safetensors",
        lambda p: p.write_bytes(p.read_bytes()[:100]),
        ["safetensors"],
    ),
    "optimizer_tail_flipped": ("optimizer.safetensors", _flip_tail, ["damaged"]),
    "rng_empty": ("rng.safetensors", lambda p: p.write_bytes(b""), ["safetensors"]),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_checkpoint_refused_on_resume(cache: Path, run: Path, capsys, case: str) -> None:
    name, damage, words = DAMAGE[case]
    target = run / LATEST / name
    damage(target)
    unlocked = lambda: {k: v for k, v in tree_snapshot(run).items() if k != ".lock"}  # noqa: E731 (the holder's)
    before = unlocked()
    assert train_cli.main(_resume_argv(cache, run)) == 2
    line = one_error_line(capsys.readouterr().err, PROG)
    assert str(target) in line, line
    for word in words:
        assert word in line, line
    assert unlocked() == before  # nothing written, nothing removed


EXPORT_DAMAGE = [c for c in sorted(DAMAGE) if DAMAGE[c][0] in ("meta.json", "model.safetensors")]


@pytest.mark.parametrize("case", EXPORT_DAMAGE)
def test_damaged_checkpoint_refused_on_export(run: Path, tmp_path: Path, capsys, case: str) -> None:
    name, damage, _ = DAMAGE[case]
    target = run / LATEST / name
    damage(target)
    assert train_cli.main(["export", str(run), "--out", str(tmp_path / "exp")]) == 2
    line = one_error_line(capsys.readouterr().err, PROG)
    assert str(target) in line, line
    assert not (tmp_path / "exp" / "model.safetensors").exists()


def test_untidy_metrics_log_still_resumes(cache: Path, run: Path, capsys) -> None:
    """metrics.jsonl is for people: a line that is a JSON list or not UTF-8 is skipped, the resume goes on."""
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b"[1, 2]\n\x00\xff garbage\n")
    assert train_cli.main(_resume_argv(cache, run)) == 0
    assert "done: step 3" in capsys.readouterr().out
    assert (run / "checkpoints/step_000003/meta.json").is_file()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(isinstance(r, dict) for r in records)
    assert [r["step"] for r in records if "loss" in r][-1] == 3


def test_grad_clip_nan_refused(cache: Path, tmp_path: Path, capsys) -> None:
    argv = tiny_train_argv(cache, tmp_path / "r", "--max-steps", "1", "--grad-clip", "nan")
    assert train_cli.main([*argv, *QUIET]) == 2
    assert "grad_clip" in one_error_line(capsys.readouterr().err, PROG)
