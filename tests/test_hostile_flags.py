"""Hostile flag values and config/row files: each is refused in one line naming the flag or file and the value."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from common.datasets import make_rows, write_arrow
from common.fake_cache import write_fake_cache
from common.hostile import one_error_line
from common.targets import write_tokenizer
from common.train_cli import tiny_train_argv
from dflash.extract.dataset import DatasetError, open_dataset
from dflash.shards.convert import ConvertConfig
from dflash.tools.shards_cli import main as shards_main
from dflash.tools.tiny import build_tiny_tokenizer, padded_vocab_size
from dflash.train import cli as train_cli
from dflash.train.config_file import load_config_file
from dflash.train.data_spec import read_eval_rows
from dflash.train.frozen import load_frozen_target
from dflash.train.mask_token import check_mask_token_id, default_mask_token_id

QUIET = ("--no-tensorboard", "--no-plots", "--no-progress", "--max-steps", "1", "--eval-every", "0")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fake_cache(tmp_path_factory.mktemp("c") / "cache", num_samples=10, samples_per_shard=5)


def _train_error(capsys: pytest.CaptureFixture[str], cache: Path, out: Path, *options: str) -> str:
    assert train_cli.main(tiny_train_argv(cache, out, *QUIET, *options)) == 2
    return one_error_line(capsys.readouterr().err, "dflash-train")


# --- 7: --config values of the wrong type, files that are not files, --eval-rows ids out of range -------------


@pytest.mark.parametrize(
    ("values", "key", "expected"),
    [
        ({"lr": "x"}, "lr", "a number"),
        ({"token_budget": {"a": 1}}, "token_budget", "an integer"),
        ({"token-budget": 1.5}, "token-budget", "an integer"),
        ({"seed": True}, "seed", "an integer"),
        ({"resume": "yes"}, "resume", "true/false"),
        ({"eval_rows": 3}, "eval_rows", "a string or null"),
        ({"max_steps": [1]}, "max_steps", "an integer or null"),
        ({"target_layer_ids": [1, "x"]}, "target_layer_ids", "a list of integers"),
        ({"target_layer_ids": {"a": 1}}, "target_layer_ids", "a list of integers"),
        ({"lr": 10**400}, "lr", "a number"),
        ({"token_budget": 2**70}, "token_budget", "an integer"),
    ],
)
def test_config_value_of_the_wrong_type_names_key_and_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], values: dict, key: str, expected: str
) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(values))
    line = _train_error(capsys, tmp_path / "nope", tmp_path / "run", "--config", str(path))
    assert f"--config {path}: {key}=" in line and f"expected {expected}" in line


def test_config_values_of_the_right_type_still_load(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"lr": 1, "max_steps": None, "target_layer_ids": [1, 2], "resume": False}))
    data = load_config_file(path)
    assert data["lr"] == 1.0 and isinstance(data["lr"], float) and data["target_layer_ids"] == [1, 2]
    toml = tmp_path / "c.toml"
    toml.write_text('lr = 2e-4\ntarget-layer-ids = "1,3"\npreset = "tiny"\n')
    assert load_config_file(toml) == {"lr": 2e-4, "target-layer-ids": "1,3", "preset": "tiny"}


@pytest.mark.parametrize("special", ["/dev/zero", "dir"])
def test_config_that_is_not_a_regular_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], special: str
) -> None:
    path = special if special.startswith("/") else str(tmp_path)
    line = _train_error(capsys, tmp_path / "nope", tmp_path / "run", "--config", path)
    assert f"--config {path}" in line


def test_config_over_the_size_limit_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "big.json"
    with open(path, "wb") as f:
        f.truncate((16 << 20) + 1)
    line = _train_error(capsys, tmp_path / "nope", tmp_path / "run", "--config", str(path))
    assert str(path) in line and "allowed" in line


@pytest.mark.parametrize(
    ("content", "shown"),
    [
        ("[99999999999999999999999]", "99999999999999999999999"),
        ("[-1]", "-1"),
        ('[1, "2"]', "'2'"),
        ("[1.5]", "1.5"),
        ("3\n99999999999999999999999\n", "99999999999999999999999"),
    ],
)
def test_eval_rows_out_of_range_names_the_file(tmp_path: Path, content: str, shown: str) -> None:
    path = tmp_path / "rows.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="row id") as info:
        read_eval_rows(path)
    assert f"--eval-rows {path}" in str(info.value) and shown in str(info.value)
    assert "\n" not in str(info.value)


def test_eval_rows_huge_id_through_the_cli(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "rows.json"
    path.write_text("[99999999999999999999999]")
    line = _train_error(capsys, cache, tmp_path / "run", "--eval-rows", str(path))
    assert f"--eval-rows {path}" in line and "99999999999999999999999" in line


def test_eval_rows_valid_forms_still_read(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text("[0, 3, 5]")
    (tmp_path / "b.txt").write_text("0\n3\n5\n")
    assert read_eval_rows(tmp_path / "a.json") == read_eval_rows(tmp_path / "b.txt") == frozenset({0, 3, 5})


# --- 8: dflash-shards convert --device ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("device", "message"),
    [("bogus", "not a device"), ("meta", "only cpu and cuda"), ("", "not a device"), ("cuda:99", "CUDA")],
)
def test_convert_bad_device_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cache: Path, device: str, message: str
) -> None:
    out = tmp_path / "out"
    argv = ["convert", str(cache), "--codec", "fp8", "--out", str(out), "--device", device]
    assert shards_main(argv) == 2
    line = one_error_line(capsys.readouterr().err, "dflash-shards")
    assert f"--device {device!r}" in line and message in line
    assert not out.exists()


def test_convert_cuda_without_cuda_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["convert", str(cache), "--codec", "fp8", "--out", str(tmp_path / "o"), "--device", "cuda"]
    assert shards_main(argv) == 2
    line = one_error_line(capsys.readouterr().err, "dflash-shards")
    assert "--device 'cuda'" in line and "no CUDA device" in line


def test_convert_config_accepts_cpu(tmp_path: Path, cache: Path) -> None:
    assert ConvertConfig(source=cache, out=tmp_path / "o", codec="fp8", device="cpu").device == "cpu"


# --- 9: messages that named neither the file nor the flag ---------------------------------------------------


def test_eval_rows_not_utf8_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cache: Path
) -> None:
    path = tmp_path / "ev.txt"
    path.write_bytes(b"\xff\xfe")
    line = _train_error(capsys, cache, tmp_path / "run", "--eval-rows", str(path))
    assert f"--eval-rows {path}" in line and "UTF-8" in line


def test_config_not_utf8_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.json"
    path.write_bytes(b"\xff\xfe")
    line = _train_error(capsys, tmp_path / "nope", tmp_path / "run", "--config", str(path))
    assert f"--config {path}" in line and "UTF-8" in line


@pytest.mark.parametrize("seed", ["-1", "99999999999999999999999", str(2**32)])
def test_seed_out_of_range_names_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cache: Path, seed: str
) -> None:
    line = _train_error(capsys, cache, tmp_path / "run", "--seed", seed)
    assert "--seed" in line and seed in line


def _truncated_arrow(tmp_path: Path) -> Path:
    """A one-batch Arrow stream cut inside the batch's body (pyarrow reports a short read, an OSError)."""
    path = write_arrow(
        make_rows(200, seed=3), tmp_path / "ds" / "data.arrow", stream=True, rows_per_batch=1000
    )
    path = Path(path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def test_truncated_arrow_names_the_file(tmp_path: Path) -> None:
    path = _truncated_arrow(tmp_path)
    with pytest.raises(DatasetError, match="damaged or truncated") as info:
        open_dataset(path.parent)
    assert str(path) in str(info.value)


def test_verify_with_a_truncated_dataset_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cache: Path
) -> None:
    path = _truncated_arrow(tmp_path)
    assert shards_main(["verify", str(cache), "--dataset", str(path.parent)]) == 2
    line = one_error_line(capsys.readouterr().err, "dflash-shards")
    assert str(path) in line and "damaged or truncated" in line


# --- 10: --mask-token-id on a token the tokenizer uses for text ------------------------------------------------


def test_mask_token_id_of_a_text_token_is_refused_naming_the_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cache: Path
) -> None:
    line = _train_error(capsys, cache, tmp_path / "run", "--mask-token-id", "55")
    assert "mask_token_id 55 (--mask-token-id) is the text token 't55' of" in line
    assert "leave it unset for the first unused row, 90" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_mask_token_ids_left_to_choose_pass(tmp_path: Path, cache: Path) -> None:
    """Rows past the tokenizer and special tokens pass; a tokenizer that fills the table leaves its special
    tokens: added ones marked special, or pieces tokenizer_config.json names (a non-special added token such
    as `<think>` is text)."""
    assert load_frozen_target(cache).mask_token_id == 90 and load_frozen_target(cache, mask_token_id=95)
    full = Path(shutil.copytree(cache, tmp_path / "full"))
    vocab = {"model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(94)}, "unk_token": "t0"}}
    added = [
        {"id": 94, "content": "<|mask|>", "special": True},
        {"id": 95, "content": "<think>", "special": False},
    ]
    (full / "target" / "tokenizer.json").write_text(json.dumps({**vocab, "added_tokens": added}))
    (full / "target" / "tokenizer_config.json").write_text(json.dumps({"pad_token": {"content": "t3"}}))
    assert load_frozen_target(full, mask_token_id=94).mask_token_id == 94
    assert load_frozen_target(full, mask_token_id=3).mask_token_id == 3
    with pytest.raises(ValueError, match=r"is the text token '<think>' .*: .*pick a special token"):
        load_frozen_target(full, mask_token_id=95)


def test_default_mask_token_id_of_the_test_targets_is_no_text_token(tmp_path: Path) -> None:
    """The tiny targets' tokenizer (tests/common/targets.py; the fake cache's is checked above) and the built-in
    one (byte-level BPE; its special tokens also sit in the BPE vocabulary)."""
    (tmp_path / "targets").mkdir()
    write_tokenizer(tmp_path / "targets")
    assert default_mask_token_id(tmp_path / "targets", 256) == 255
    check_mask_token_id(tmp_path / "targets", 255, 256)
    tokenizer = build_tiny_tokenizer(tmp_path, vocab_size=300)
    rows = padded_vocab_size(len(tokenizer))
    default = default_mask_token_id(tmp_path, rows)
    assert default == len(tokenizer)
    for token_id in (default, rows - 1, tokenizer.convert_tokens_to_ids("<|im_end|>")):
        check_mask_token_id(tmp_path, token_id, rows)
    with pytest.raises(ValueError, match=r"mask_token_id 5 \(--mask-token-id\) is the text token"):
        check_mask_token_id(tmp_path, 5, rows)
