"""Hostile and damaged inputs of `dflash-train` (issue 16): NaN samples, decompression bombs, run and
export directories it must not write, manifests and frozen parts it must not trust, empty caches. Each
ends in one line and exit 2, in bounded memory, and never leaves a NaN checkpoint or export behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from common.fake_cache import write_fake_cache
from common.hostile import (
    add_shard,
    bomb_sample,
    cli,
    copy_shard,
    one_error_line,
    record_target_files,
    repeat_row,
    resign_manifest,
    run_measured,
    tree_snapshot,
)
from common.train_cli import tiny_train_argv
from dflash.shards import Cache, load_manifest, save_manifest, verify_cache
from dflash.train import cli as train_cli
from dflash.train.data_plan import heldout_mask
from safetensors.torch import load_file, save_file

PROG = "dflash-train"
QUIET = ("--no-tensorboard", "--no-plots")
RSS_BOUND_MB = 1000  # a tiny training run peaks near 500-600 MB here; the bomb decoded whole is > 2 GB
BOMB_TOKENS = 1 << 23


def _trained_row(first: int, skip: int = 0) -> int:
    """A row id >= first the tiny preset trains on (not held out by its 0.2 hash holdout)."""
    rows = np.arange(first, first + 100, dtype=np.int64)
    return int(rows[~heldout_mask(rows, 0.2)][skip])


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert train_cli.main(argv) == 2
    return one_error_line(capsys.readouterr().err, PROG)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fake_cache(tmp_path_factory.mktemp("t") / "cache", num_samples=30, samples_per_shard=10)


@pytest.fixture
def cache(template: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(template, tmp_path / "cache"))


@pytest.fixture(scope="module")
def run(template: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished two-step run with a checkpoint (for export tests)."""
    out = tmp_path_factory.mktemp("run") / "run"
    assert (
        train_cli.main(tiny_train_argv(template, out, "--max-steps", "2", "--eval-every", "0", *QUIET)) == 0
    )
    return out


# --- item 1: a NaN sample with valid checksums ---------------------------------------------------------------


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
        ),
    ],
)
def test_nan_sample_stops_training_naming_step_and_row(tmp_path: Path, capsys, device: str) -> None:
    bad = _trained_row(0, skip=3)
    cache = write_fake_cache(tmp_path / "cache", num_samples=30, samples_per_shard=10, nonfinite_rows=(bad,))
    out = tmp_path / "run"
    argv = tiny_train_argv(
        cache, out, "--max-steps", "30", "--save-every", "2", "--eval-every", "2", "--device", device, *QUIET
    )
    line = _refused(capsys, argv)
    assert "dflash-train: error: step " in line and f"row {bad} (layer 2: 2 NaN/inf)" in line, line
    saved = [*out.glob("checkpoints/*/model.safetensors"), *out.glob("*/model.safetensors")]
    for path in saved:  # whatever was written before the bad step is finite
        assert all(torch.isfinite(t).all() for t in load_file(path).values()), path
    losses = [
        json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x
    ]
    assert all(np.isfinite(losses))


# --- item 2: bombs; --max-length applied before decoding --------------------------------------------------------


def test_long_sample_decodes_only_max_length_tokens(cache: Path) -> None:
    """The cache declares samples up to 2^23 tokens; training at --max-length 128 never decodes the rest."""
    m = load_manifest(cache)
    m.options["max_len"] = BOMB_TOKENS
    save_manifest(cache, m)
    add_shard(cache, 3, [bomb_sample(cache, row=_trained_row(30), tokens=BOMB_TOKENS)])
    argv = tiny_train_argv(
        cache, cache.parent / "run", "--epochs", "1", "--eval-every", "0", *QUIET
    )  # every row
    rc, err, rss = run_measured(cli("dflash.train.cli", *argv), timeout=300)
    assert rc == 0, err[-3000:]
    assert rss < RSS_BOUND_MB, f"peak RSS {rss} MB"


def test_bomb_beyond_the_declared_length_is_one_line(cache: Path, capsys) -> None:
    add_shard(cache, 3, [bomb_sample(cache, row=30, tokens=BOMB_TOKENS)])
    line = _refused(capsys, tiny_train_argv(cache, cache.parent / "run", "--max-steps", "4", *QUIET))
    assert f"length {BOMB_TOKENS} exceeds the 40 tokens the cache declares" in line


# --- item 4: directories a run or an export must not write -----------------------------------------------------


def test_run_out_over_user_files_is_refused_untouched(cache: Path, tmp_path: Path, capsys) -> None:
    mine = tmp_path / "mine"
    (mine / "export").mkdir(parents=True)
    (mine / "config.json").write_text('{"mine": true}')
    (mine / "metrics.jsonl").write_text('{"step": 1}\n')
    (mine / "export" / "model.safetensors").write_bytes(b"my model")
    before = tree_snapshot(mine)
    rc = train_cli.main(tiny_train_argv(cache, mine, "--max-steps", "2", *QUIET))
    assert tree_snapshot(mine) == before
    assert rc == 2 and "was not written by dflash" in one_error_line(capsys.readouterr().err, PROG)


def test_train_and_export_never_write_into_a_cache(cache: Path, run: Path, capsys) -> None:
    config = (cache / "target" / "config.json").read_bytes()
    for argv in (
        tiny_train_argv(cache, cache / "target", "--max-steps", "2", *QUIET),
        ["export", str(run), "--out", str(cache / "target")],
        ["export", str(run), "--out", str(cache / "exports" / "new")],
    ):
        assert f"is inside the dflash cache {cache}" in _refused(capsys, argv)
    assert (cache / "target" / "config.json").read_bytes() == config and not (cache / "exports").exists()
    with Cache.open(cache) as c:
        assert verify_cache(c).ok


# --- items 6 and 7: manifests and frozen parts a run must not trust --------------------------------------------------


def _frozen_path(cache: Path) -> str:
    return str(cache / "target" / "frozen.safetensors")


def _drop_target(cache: Path) -> tuple[str, ...]:
    resign_manifest(cache, lambda d: d.pop("target"))
    return ()


def _small_vocab(cache: Path) -> tuple[str, ...]:
    frozen = load_file(_frozen_path(cache))
    save_file({k: v[:60].contiguous() for k, v in frozen.items()}, _frozen_path(cache))
    record_target_files(cache)
    return ("--mask-token-id", "55")  # a row inside the shrunken table; the cached ids (up to 89) are not


def _manifest_vocab_past_frozen(cache: Path) -> tuple[str, ...]:
    resign_manifest(
        cache, lambda d: d["target"].update(vocab_size=200)
    )  # ids up to 199 would pass the reader
    return ()


def _int_weights(cache: Path) -> tuple[str, ...]:
    frozen = load_file(_frozen_path(cache))
    save_file({k: v.to(torch.int32) for k, v in frozen.items()}, _frozen_path(cache))
    record_target_files(cache)
    return ()


def _nonfinite_embed(cache: Path) -> tuple[str, ...]:
    frozen = load_file(_frozen_path(cache))
    embed = frozen["embed_tokens.weight"]
    embed[3, :2], embed[40, 5], embed[95, -2:] = float("nan"), float("-inf"), float("inf")
    save_file(frozen, _frozen_path(cache))
    record_target_files(cache)
    return ()


def _nonfinite_lm_head(cache: Path) -> tuple[str, ...]:
    frozen = load_file(_frozen_path(cache))
    frozen["lm_head.weight"][7, 11] = float("nan")
    save_file(frozen, _frozen_path(cache))
    record_target_files(cache)
    return ()


def _config_without_layers(cache: Path) -> tuple[str, ...]:
    config = json.loads((cache / "target" / "config.json").read_text())
    del config["num_hidden_layers"]
    (cache / "target" / "config.json").write_text(json.dumps(config))
    record_target_files(cache)
    return ()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_drop_target, "target.config_sha256 is missing or malformed"),
        (
            _small_vocab,
            "embed_tokens.weight is [60, 32], config.json says [vocab_size, hidden_size] = [96, 32]",
        ),
        (_manifest_vocab_past_frozen, "96 embedding rows, fewer than the target's vocab_size 200"),
        (_int_weights, "embed_tokens.weight is I32, not a float of 16 bits or more"),
        (_config_without_layers, "config.json lacks integer num_hidden_layers"),
        (_nonfinite_embed, "target/frozen.safetensors: embed_tokens holds 5 NaN/inf values"),
        (_nonfinite_lm_head, "target/frozen.safetensors: lm_head holds 1 NaN/inf values"),
    ],
)
def test_untrustworthy_cache_refused_before_step_one(cache: Path, capsys, damage, message: str) -> None:
    extra = damage(cache)
    argv = tiny_train_argv(cache, cache.parent / "run", "--max-steps", "2", *QUIET, *extra)
    assert message in _refused(capsys, argv)
    assert not (cache.parent / "run" / "checkpoints").exists()
    assert not (cache.parent / "run" / "metrics.jsonl").exists()  # refused before the first step


@pytest.mark.parametrize("damage", ["copied shard", "relabelled row"])
def test_row_in_two_shards_refused_before_step_one_whatever_the_policy(
    cache: Path, capsys, damage: str
) -> None:
    """Trained twice per epoch before; `--on-corrupt skip` must not drop a shard over it either."""
    if damage == "copied shard":
        copy_shard(cache, 1, 3)
        row, shards = 10, ("shard-000001.dfs", "shard-000003.dfs")
    else:
        repeat_row(cache, 2, 0, 15)
        row, shards = 15, ("shard-000001.dfs", "shard-000002.dfs")
    for policy in ("fail", "skip"):
        out = cache.parent / f"run-{policy}"
        line = _refused(
            capsys, tiny_train_argv(cache, out, "--max-steps", "2", "--on-corrupt", policy, *QUIET)
        )
        assert f"row {row} is stored in both" in line and all(name in line for name in shards), line
        assert f"dflash-shards verify {cache}" in line
        metrics = (
            out / "metrics.jsonl"
        )  # the copied shard refuses at open, the relabelled row at the first batch
        assert not metrics.exists() or not metrics.read_text().strip()  # either way before the first step


def test_layout_mismatch_names_its_cause_not_a_skip(cache: Path, capsys) -> None:
    """A manifest that no longer describes its shards: `--on-corrupt skip` would drop every shard."""
    resign_manifest(cache, lambda d: d.update(dtype="float16"))
    line = _refused(capsys, tiny_train_argv(cache, cache.parent / "run", "--max-steps", "2", *QUIET))
    assert "its header disagrees with the manifest (dtype 'bfloat16' != manifest 'float16')" in line
    assert "this shard or manifest.json was replaced" in line and "re-extract" in line
    assert f"dflash-shards verify {cache}" in line and "--on-corrupt" not in line


def test_every_shard_skipped_is_refused_not_trained_on_nothing(cache: Path, capsys) -> None:
    """Under `--on-corrupt skip` a manifest that disagrees with every shard used to end the run at once, exit 0
    and export an untrained drafter."""
    resign_manifest(cache, lambda d: d.update(dtype="float16"))
    argv = tiny_train_argv(cache, cache.parent / "run", "--max-steps", "2", "--on-corrupt", "skip", *QUIET)
    line = _refused(capsys, argv)
    assert "shards skipped under --on-corrupt skip leave nothing to train on" in line
    assert "disagrees with the manifest" in line and f"dflash-shards verify {cache}" in line
    assert not (cache.parent / "run" / "export").exists()


# --- item 8: an empty cache ----------------------------------------------------------------------------------------


def test_empty_cache_is_an_error(tmp_path: Path, capsys) -> None:
    cache = write_fake_cache(tmp_path / "cache", num_samples=0)
    line = _refused(capsys, tiny_train_argv(cache, tmp_path / "run", *QUIET))
    assert "holds no samples (0 rows skipped at extraction): nothing to train on" in line


# --- shards missing or cut short: found by stat before step 1, not when the loader reaches them -------------------


@pytest.mark.parametrize("damage", ["missing", "truncated", "a directory"])
def test_a_shard_not_as_recorded_is_refused_before_step_one(cache: Path, capsys, damage: str) -> None:
    shard = cache / "shards" / "shard-000002.dfs"  # the last one: the loader would reach it last
    size = shard.stat().st_size
    if damage == "missing":
        shard.unlink()
    elif damage == "truncated":
        with shard.open("r+b") as f:
            f.truncate(size - 100)
    else:
        shard.unlink()
        shard.mkdir()
    run = cache.parent / "run"
    message = _refused(capsys, tiny_train_argv(cache, run, *QUIET))
    expected = {
        "missing": "missing, the manifest lists it",
        "truncated": f"{size - 100} bytes, the manifest records {size}",
        "a directory": "not a regular file",
    }[damage]
    assert message.startswith(f"{PROG}: error: 1 of 3 shards are not as the manifest records: {shard}: ")
    assert expected in message
    assert "--on-corrupt skip" in message
    assert not (run / "metrics.jsonl").exists()
    # The dry run, which makes the same checks, says the same.
    assert _refused(capsys, [*tiny_train_argv(cache, cache.parent / "dry", *QUIET), "--dry-run"]) == message


def test_under_skip_a_missing_shard_is_named_once_and_training_goes_on(cache: Path, caplog) -> None:
    (cache / "shards" / "shard-000002.dfs").unlink()
    run = cache.parent / "run"
    argv = tiny_train_argv(cache, run, "--max-steps", "3", "--on-corrupt", "skip", *QUIET)
    with caplog.at_level("WARNING"):
        assert train_cli.main(argv) == 0
    warned = [r.getMessage() for r in caplog.records if "shards will be skipped" in r.getMessage()]
    assert (
        len(warned) == 1 and "1 of 3 shards will be skipped" in warned[0] and "shard-000002.dfs" in warned[0]
    )
