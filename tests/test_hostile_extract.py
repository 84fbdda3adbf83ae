"""Hostile and damaged inputs of `dflash-extract` (issue 16): non-finite targets, planted links, foreign
`--out` directories, empty datasets, path spelling on resume, dataset metadata pointing elsewhere. Each
ends in one line and exit 2 (or the documented skip with a count) and touches nothing it must not."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from common.datasets import write_arrow
from common.extract import cpu_extract_argv, tiny_rows, write_dataset
from common.hostile import one_error_line, tree_snapshot
from common.targets import make_target
from dflash.extract.cli import main as extract_main
from dflash.shards import Cache, load_manifest, tensor_io, verify_cache
from dflash.shards.outdir import claim_out_dir
from dflash.tools.shards_cli import main as shards_main
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

PROG = "dflash-extract"


@pytest.fixture(scope="module")
def rows() -> list:
    return tiny_rows(12)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory, rows: list) -> Path:
    return write_dataset(tmp_path_factory.mktemp("ds"), rows)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_target(tmp_path_factory.mktemp("t"), "qwen3")


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert extract_main(argv) == 2
    return one_error_line(capsys.readouterr().err, PROG)


def _rare_token(rows: list) -> tuple[int, list[int]]:
    """A token id that occurs in some, not all, kept rows, and those rows."""
    kept = [r for r, (ids, mask) in enumerate(rows) if len(ids) and mask[:32].sum()]
    for token in range(3, 256):
        having = [r for r in kept if token in rows[r][0][:32]]
        if 0 < len(having) < len(kept) // 2:
            return token, having
    raise AssertionError("no rare token in the test rows")


def _poisoned_target(src: Path, dst: Path, token: int | None) -> Path:
    """A copy of `src` with one inf weight: token `token`'s embedding row, or (None) one MLP weight."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    if token is None:
        weights["model.layers.0.mlp.down_proj.weight"][0, 0] = float("inf")
    else:
        weights["model.embed_tokens.weight"][token, 0] = float("inf")
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


# --- item 1: a target with an inf weight ------------------------------------------------------------


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# The flags are computed where the forward runs (the GPU in real use), before fp8 quantization.
ON_DEVICES = [
    pytest.param("cpu", "lossless"),
    pytest.param("cpu", "fp8"),
    pytest.param("cuda", "lossless", marks=[pytest.mark.cuda, CUDA]),
    pytest.param("cuda", "fp8", marks=[pytest.mark.cuda, CUDA]),
]


def _device_args(device: str, codec: str) -> list[str]:
    return ["--device", device, "--codec", codec, *(["--no-compile"] if device == "cuda" else [])]


@pytest.mark.parametrize(("device", "codec"), ON_DEVICES)
def test_nonfinite_states_stop_extraction_naming_row_and_layer(
    tmp_path, capsys, dataset, qwen3, device, codec
) -> None:
    target = _poisoned_target(qwen3, tmp_path / "inf_target", None)
    line = _refused(
        capsys, cpu_extract_argv(target, dataset, tmp_path / "cache", *_device_args(device, codec))
    )
    assert "the target produced non-finite hidden states (layer 0:" in line and "--on-nonfinite skip" in line
    assert (
        not (tmp_path / "cache" / "manifest.json").exists() or not load_manifest(tmp_path / "cache").complete
    )


@pytest.mark.parametrize(("device", "codec"), ON_DEVICES)
def test_nonfinite_rows_skipped_and_counted(tmp_path, capsys, rows, dataset, qwen3, device, codec) -> None:
    token, poisoned = _rare_token(rows)
    target = _poisoned_target(qwen3, tmp_path / "inf_row", token)
    out = tmp_path / "cache"
    argv = cpu_extract_argv(target, dataset, out, "--on-nonfinite", "skip", *_device_args(device, codec))
    assert extract_main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    manifest = load_manifest(out)
    nonfinite = {s["row"] for s in manifest.skipped if s["reason"].startswith("non-finite hidden states")}
    assert nonfinite == set(poisoned) and result["rows_nonfinite"] == len(poisoned)
    with Cache.open(out) as cache:
        stored = {e.row for e in cache.entries()}
        assert not stored & nonfinite
        report = verify_cache(cache, dataset_rows=len(rows))  # every row stored once or skipped
    assert report.ok, report.lines()


# --- item 3: a planted .lock link --------------------------------------------------------------------------


def test_planted_lock_link_is_not_followed(tmp_path, capsys, dataset, qwen3) -> None:
    out = claim_out_dir(tmp_path / "cache", "cache")  # a cache dir, as a first (killed) run left it
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (out / ".lock").symlink_to(victim)
    assert "is a symbolic link: refusing to write through it" in _refused(
        capsys, cpu_extract_argv(qwen3, dataset, out)
    )
    assert victim.read_text() == "precious\n"


# --- item 4: --out directories dflash did not write ---------------------------------------------------------


def _foreign_with_shards(root: Path) -> Path:
    (root / "shards").mkdir(parents=True)
    (root / "shards" / ".shard-000000.dfs.tmp-999").write_bytes(b"user data")
    (root / "shards" / "shard-000000.dfs").write_bytes(b"not a shard")
    return root


def _only_dotfiles(root: Path) -> Path:
    (root / ".git").mkdir(parents=True)
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return root


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (_foreign_with_shards, "is not empty (shards) and was not written by dflash"),
        (_only_dotfiles, "is not empty (.git) and was not written by dflash"),
    ],
)
def test_foreign_out_is_refused_untouched(tmp_path, capsys, dataset, qwen3, make, message) -> None:
    out = make(tmp_path / "out")
    before = tree_snapshot(out)
    rc = extract_main(cpu_extract_argv(qwen3, dataset, out))
    assert tree_snapshot(out) == before  # nothing deleted, no .lock left behind
    assert rc == 2 and message in one_error_line(capsys.readouterr().err, PROG)


def test_out_equal_to_dataset_or_a_file(tmp_path, capsys, qwen3, rows) -> None:
    dataset = write_dataset(tmp_path / "ds", rows)
    before = tree_snapshot(dataset)
    assert "was not written by dflash" in _refused(capsys, cpu_extract_argv(qwen3, dataset, dataset))
    assert tree_snapshot(dataset) == before
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    assert "is a regular file, not a directory" in _refused(capsys, cpu_extract_argv(qwen3, dataset, notes))
    assert notes.read_text() == "mine"


# --- item 7: tracebacks instead of one line --------------------------------------------------------------


def test_disk_full_writing_frozen_parts_is_one_line(tmp_path, capsys, dataset, qwen3, monkeypatch) -> None:
    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(tensor_io, "save_file", full)
    line = _refused(capsys, cpu_extract_argv(qwen3, dataset, tmp_path / "cache"))
    assert "frozen.safetensors: no space left on device" in line and "re-run the same command" in line


@pytest.mark.parametrize(
    ("config", "message"),
    [([1, 2, 3], "holds a JSON list, not a config object"), ("drop", "lacks integer num_hidden_layers")],
)
def test_malformed_target_config_is_one_line(tmp_path, capsys, dataset, qwen3, config, message) -> None:
    target = Path(shutil.copytree(qwen3, tmp_path / "target"))
    if config == "drop":
        config = json.loads((target / "config.json").read_text())
        del config["num_hidden_layers"]
    (target / "config.json").write_text(json.dumps(config))
    assert message in _refused(capsys, cpu_extract_argv(target, dataset, tmp_path / "cache"))


def test_mixed_schema_dataset_is_one_line(tmp_path, capsys, rows, qwen3) -> None:
    mixed = tmp_path / "mixed"
    write_arrow(rows[:6], mixed / "a.arrow")
    write_arrow(rows[6:], mixed / "b.arrow", ids_type=pa.int64())
    line = _refused(capsys, cpu_extract_argv(qwen3, mixed, tmp_path / "cache"))
    assert "b.arrow: schema differs from a.arrow (input_ids: list<item: int64> vs list<item: int32>)" in line


# --- item 8: empty inputs ---------------------------------------------------------------------------------


def test_empty_dataset_is_an_error_unless_allowed(tmp_path, capsys, qwen3) -> None:
    nothing = [(np.arange(3, 9), np.zeros(6, np.int64))] * 3  # rows without a supervised token: all skipped
    dataset = write_dataset(tmp_path / "ds", nothing)
    out = tmp_path / "cache"
    line = _refused(capsys, cpu_extract_argv(qwen3, dataset, out))
    assert "no row to extract (3 rows, 3 skipped" in line and "--allow-empty" in line
    assert not out.exists()
    assert extract_main(cpu_extract_argv(qwen3, dataset, out, "--allow-empty")) == 0
    with Cache.open(out) as cache:
        assert cache.entries() == [] and verify_cache(cache, dataset_rows=3).ok


# --- item 9: resume compares the target, not the spelling of its path ----------------------------------------


def test_resume_with_the_target_path_spelled_otherwise(tmp_path, capsys, dataset, qwen3, monkeypatch) -> None:
    out = tmp_path / "cache"
    assert extract_main(cpu_extract_argv(qwen3, dataset, out)) == 0
    monkeypatch.chdir(qwen3.parent)
    assert (
        extract_main(cpu_extract_argv(Path(qwen3.name), dataset, out)) == 0
    )  # relative: same target, same cache
    capsys.readouterr()
    other = make_target(tmp_path / "other", "qwen3", seed=1)  # same config.json, other weights
    line = _refused(capsys, cpu_extract_argv(other, dataset, out))
    assert "resume refused" in line and "target.weights_sha256" in line and "name_or_path" not in line


def test_a_dataset_retokenized_to_the_same_lengths_is_caught(tmp_path, capsys, rows, dataset, qwen3) -> None:
    out = tmp_path / "cache"
    assert extract_main(cpu_extract_argv(qwen3, dataset, out)) == 0
    capsys.readouterr()
    # Same rows, lengths, masks, dtypes and file sizes; other token ids in the first rows.
    changed = [((ids + 1) % 200 if r < 4 else ids, mask) for r, (ids, mask) in enumerate(rows)]
    other = write_dataset(tmp_path / "other", changed)
    assert sorted(f.stat().st_size for f in other.rglob("*.arrow")) == sorted(
        f.stat().st_size for f in dataset.rglob("*.arrow")
    )
    shards = lambda: {k: v for k, v in tree_snapshot(out).items() if k != ".lock"}  # noqa: E731
    before = shards()
    line = _refused(capsys, cpu_extract_argv(qwen3, other, out))
    assert "resume refused" in line and "dataset.tokens_xxh3" in line
    assert shards() == before  # the cache is left as it was (only the run lock was taken and given back)
    assert shards_main(["verify", str(out), "--dataset", str(dataset)]) == 0
    capsys.readouterr()
    assert shards_main(["verify", str(out), "--dataset", str(other)]) == 1
    report = capsys.readouterr().out
    assert "FAILED" in report and "the dataset's token ids or loss masks differ" in report


# --- item 10: dataset metadata pointing outside its directory -----------------------------------------------


@pytest.mark.parametrize("where", ["../elsewhere/data.arrow", "absolute"])
def test_state_json_may_not_point_outside(tmp_path, capsys, rows, qwen3, where) -> None:
    dataset = write_dataset(tmp_path / "ds", rows)
    elsewhere = tmp_path / "ds" / "elsewhere"
    elsewhere.mkdir()
    data_file = next(dataset.glob("data-*.arrow"))
    shutil.copy(data_file, elsewhere / "data.arrow")
    name = str(elsewhere / "data.arrow") if where == "absolute" else where
    state = json.loads((dataset / "state.json").read_text())
    state["_data_files"][0]["filename"] = name
    (dataset / "state.json").write_text(json.dumps(state))
    line = _refused(capsys, cpu_extract_argv(qwen3, dataset, tmp_path / "cache"))
    assert f"state.json: {name!r} points outside the dataset directory" in line
    assert not (tmp_path / "cache").exists()


def test_dataset_dict_split_may_not_point_outside(tmp_path, capsys, rows, qwen3) -> None:
    write_dataset(tmp_path / "elsewhere", rows)
    ddict = tmp_path / "ddict"
    ddict.mkdir()
    (ddict / "dataset_dict.json").write_text(json.dumps({"splits": ["../elsewhere/dataset"]}))
    line = _refused(capsys, cpu_extract_argv(qwen3, ddict, tmp_path / "cache"))
    assert "dataset_dict.json: '../elsewhere/dataset' points outside the dataset directory" in line


def test_poisoned_target_helper_really_poisons(tmp_path, qwen3) -> None:
    target = _poisoned_target(qwen3, tmp_path / "t", 7)
    assert torch.isinf(load_file(target / "model.safetensors")["model.embed_tokens.weight"][7, 0])
    assert os.path.getsize(target / "model.safetensors") == os.path.getsize(qwen3 / "model.safetensors")
