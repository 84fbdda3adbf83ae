"""Hostile cases that escaped until issue 31: a target checkpoint cut short, a shard file whose name ends in a
newline, manifest shard names that are not `shard-NNNNNN.dfs`, a shard's manifest entry removed. Each is one
line and exit 2 (or, for the stray file, a resume that completes), never a traceback."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from common.extract import cpu_extract_argv, make_config, tiny_rows, write_dataset
from common.fake_cache import write_fake_cache
from common.hostile import one_error_line, resign_manifest
from common.targets import make_target
from common.train_cli import tiny_train_argv
from dflash.extract.cli import main as extract_main
from dflash.extract.pipeline import run_extraction
from dflash.extract.units import committed_units
from dflash.shards import Cache, load_manifest, save_manifest, verify_cache
from dflash.shards.paths import unit_of_shard
from dflash.tools.shards_cli import main as shards_main
from dflash.train import cli as train_cli

QUIET = ("--no-tensorboard", "--no-plots", "--no-progress")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("ds"), tiny_rows(12))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_target(tmp_path_factory.mktemp("t"), "qwen3")


@pytest.fixture(scope="module")
def extracted(tmp_path_factory: pytest.TempPathFactory, qwen3: Path, dataset: Path) -> Path:
    out = tmp_path_factory.mktemp("c") / "cache"
    run_extraction(make_config(qwen3, dataset, out, unit_bytes=8 << 10))
    assert len(load_manifest(out).shards) >= 2
    return out


# --- a target checkpoint cut short -----------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [100, 100_000])  # inside the data, inside the header
def test_truncated_target_is_one_line_and_out_untouched(
    tmp_path: Path, capsys, qwen3: Path, dataset: Path, cut: int
) -> None:
    target = Path(shutil.copytree(qwen3, tmp_path / "target"))
    weights = target / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: max(9, len(data) - cut)])
    out = tmp_path / "out"
    assert extract_main(cpu_extract_argv(target, dataset, out)) == 2
    line = one_error_line(capsys.readouterr().err, "dflash-extract")
    assert str(weights) in line and ("cut short" in line or "not a safetensors file" in line), line
    assert not out.exists()  # refused before --out was claimed: no .dflash, .lock or manifest left


def test_cache_files_have_the_umasks_mode(tmp_path: Path, qwen3: Path, dataset: Path) -> None:
    """What extraction publishes (manifest, shards, target/ with its safetensors file) is readable by the
    group when the umask says so: safetensors alone writes 0600."""
    old = os.umask(0o002)
    try:
        out = tmp_path / "cache"
        run_extraction(make_config(qwen3, dataset, out, unit_bytes=8 << 10))
    finally:
        os.umask(old)
    files = [out / "manifest.json", *out.glob("shards/*"), *out.glob("target/*")]
    assert (out / "target" / "frozen.safetensors") in files and len(list(out.glob("shards/*"))) >= 2
    modes = {str(p.relative_to(out)): oct(p.stat().st_mode & 0o777) for p in files}
    assert set(modes.values()) == {oct(0o664)}, modes


# --- a stray file named like a shard plus a newline ------------------------------------------------------------


def test_shard_name_with_trailing_newline_is_not_a_shard() -> None:
    assert unit_of_shard("shard-000001.dfs") == 1
    for name in (
        "shard-000001.dfs\n",
        "shard-000001.dfs\n\n",
        "shard-\u0661\u0662\u0663\u0664\u0665\u0666.dfs",
    ):
        assert unit_of_shard(name) is None, repr(name)


def test_resume_redoes_a_unit_whose_shard_name_ends_in_newline(
    tmp_path: Path, extracted: Path, qwen3: Path, dataset: Path
) -> None:
    out = Path(shutil.copytree(extracted, tmp_path / "cache"))
    manifest = load_manifest(out)
    lost = manifest.shards[1].name
    (out / "shards" / lost).rename(out / "shards" / f"{lost}\n")  # a committed shard under a stray name
    manifest.complete, manifest.shards = False, []
    save_manifest(out, manifest)
    assert 1 not in committed_units(out)
    run_extraction(make_config(qwen3, dataset, out, unit_bytes=8 << 10))  # old code: Errno 2 on every re-run
    assert (out / "shards" / lost).is_file() and load_manifest(out).complete
    with Cache.open(out, unique_rows=False) as cache:
        assert verify_cache(cache, dataset_rows=12).ok


# --- manifest shard names ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["shard-000001.dfs\n", "shard-é\n.dfs", "shard-1.dfs", "shard-x00001.dfs"])
def test_manifest_shard_name_not_of_the_form_is_refused(tmp_path: Path, capsys, bad: str) -> None:
    cache = write_fake_cache(tmp_path / "cache", num_samples=20, samples_per_shard=10)
    old = "shard-000001.dfs"
    (cache / "shards" / old).rename(cache / "shards" / bad)
    d = json.loads((cache / "manifest.json").read_text())
    d["shards"][1]["name"] = bad
    (cache / "manifest.json").write_text(json.dumps(d))
    assert shards_main(["verify", str(cache)]) == 2
    line = one_error_line(capsys.readouterr().err, "dflash-shards")
    assert f"shard name {bad!r} is not of the form shard-NNNNNN.dfs" in line, line


# --- a shard's manifest entry removed ---------------------------------------------------------------------------


@pytest.fixture
def unlisted(tmp_path: Path) -> Path:
    """A complete cache of 40 rows whose manifest no longer lists shard-000002.dfs (the file is kept)."""
    cache = write_fake_cache(tmp_path / "cache", num_samples=40, samples_per_shard=10)
    d = json.loads((cache / "manifest.json").read_text())
    d["shards"] = [s for s in d["shards"] if s["name"] != "shard-000002.dfs"]
    (cache / "manifest.json").write_text(json.dumps(d))
    return cache


@pytest.mark.parametrize("dry", [False, True])
def test_shard_missing_from_manifest_is_refused_by_training(
    unlisted: Path, tmp_path: Path, capsys, dry
) -> None:
    argv = tiny_train_argv(
        unlisted, tmp_path / "run", "--max-steps", "2", *QUIET, *(["--dry-run"] if dry else [])
    )
    assert train_cli.main(argv) == 2
    line = one_error_line(capsys.readouterr().err, "dflash-train")
    assert "its manifest accounts for 30 of the dataset's 40 rows (30 stored, 0 skipped)" in line, line
    assert "shard files it does not list: shard-000002.dfs" in line
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_shard_missing_from_manifest_is_named_under_skip(unlisted: Path, tmp_path: Path, caplog) -> None:
    argv = tiny_train_argv(unlisted, tmp_path / "run", "--max-steps", "2", "--on-corrupt", "skip", *QUIET)
    assert train_cli.main(argv) == 0
    assert "accounts for 30 of the dataset's 40 rows" in caplog.text


def test_cache_with_skipped_rows_accounts_for_every_row(tmp_path: Path, capsys) -> None:
    """Rows extraction skipped (listed in `skipped`) are accounted for: no refusal."""
    cache = write_fake_cache(tmp_path / "cache", num_samples=20, samples_per_shard=10)
    resign_manifest(
        cache,
        lambda d: d.update(skipped=[{"row": 20, "reason": "too long"}], dataset={**d["dataset"], "rows": 21}),
    )
    argv = tiny_train_argv(cache, tmp_path / "run", "--max-steps", "1", "--dry-run", *QUIET)
    assert train_cli.main(argv) == 0, capsys.readouterr().err
