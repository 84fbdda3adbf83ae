"""Released-layout tied targets (Qwen3-0.6B/1.7B/4B: bf16, `tie_word_embeddings: true`, no lm_head.weight)
end to end through the CLIs, and the rule that CACHE/target/ fails a run before its first batch."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from dflash.extract import pipeline
from dflash.extract.cli import main as extract_main
from dflash.shards import Cache, read_target_parts
from dflash.shards.paths import committed_shard_names
from dflash.train.cli import main as train_main
from dflash.train.export import load_drafter
from dflash.train.frozen import load_frozen_target
from safetensors import safe_open

from tests.common.extract import tiny_rows, write_dataset
from tests.common.targets import make_target
from tests.common.train_cli import tiny_train_argv


def _extract_argv(target: Path, dataset: Path, out: Path) -> list[str]:
    paths = ["--target", str(target), "--dataset", str(dataset), "--out", str(out)]
    return [*paths, "--device", "cpu", "--layers", "1,2", "--json"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data"), tiny_rows(16, max_len=24))


def test_bf16_tied_checkpoint_extracts_trains_and_exports(tmp_path: Path, dataset: Path) -> None:
    target = make_target(tmp_path, "qwen3", tie=True, dtype=torch.bfloat16)
    with safe_open(str(target / "model.safetensors"), framework="pt") as f:  # saved as transformers saves it
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118 (safe_open is not a mapping)
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    cache = tmp_path / "cache"
    assert extract_main(_extract_argv(target, dataset, cache)) == 0
    parts = read_target_parts(cache)
    assert parts.tied and parts.embed.dtype == torch.bfloat16
    frozen = load_frozen_target(cache, mask_token_id=255, dtype=torch.float32)
    assert frozen.tied  # one [V, H] matrix on the device, not two

    run, export = tmp_path / "run", tmp_path / "export"
    argv = tiny_train_argv(cache, run, "--max-steps", "3", "--eval-every", "3", "--mask-token-id", "255")
    assert train_main([*argv, "--no-tensorboard", "--no-plots"]) == 0
    assert train_main(["export", str(run), "--out", str(export)]) == 0
    drafter = load_drafter(export)
    assert drafter.config.target_layer_ids == (2,) and drafter.config.mask_token_id == 255


def _bad_target_is_refused_before_the_first_batch(
    target: Path, dataset: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> str:
    def no_forward(*args: object, **kwargs: object) -> None:
        raise AssertionError("the target was loaded before CACHE/target/ was checked")

    monkeypatch.setattr(pipeline, "load_target", no_forward)
    capsys.readouterr()  # drop save_pretrained's progress output
    assert extract_main(_extract_argv(target, dataset, cache)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and not committed_shard_names(cache)
    return err


def test_missing_lm_head_fails_before_the_first_batch(
    tmp_path: Path, dataset: Path, monkeypatch, capsys
) -> None:
    from safetensors.torch import load_file, save_file

    target = make_target(tmp_path, "qwen3", dtype=torch.bfloat16)
    tensors = load_file(str(target / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(target / "model.safetensors"))
    err = _bad_target_is_refused_before_the_first_batch(target, dataset, tmp_path / "c", monkeypatch, capsys)
    assert "tie_word_embeddings is false but the checkpoint has no lm_head" in err


def test_frozen_parts_disagreeing_with_the_config_fail_before_the_first_batch(
    tmp_path: Path, dataset: Path, monkeypatch, capsys
) -> None:
    target = make_target(tmp_path, "qwen3", tie=True, dtype=torch.bfloat16)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "hidden_size": 96}))
    err = _bad_target_is_refused_before_the_first_batch(target, dataset, tmp_path / "c", monkeypatch, capsys)
    assert "frozen.safetensors: embed_tokens.weight is [256, 64], config.json says" in err


def test_a_failure_at_the_end_of_a_run_is_one_line_naming_the_file(
    tmp_path: Path, dataset: Path, monkeypatch, capsys
) -> None:
    target = make_target(tmp_path, "qwen3", tie=True, dtype=torch.bfloat16)
    cache = tmp_path / "cache"
    real_save = pipeline.save_manifest

    def failing_final_save(cache_dir: Path, manifest):  # the disk fails as the manifest is finalized
        if manifest.complete:
            raise OSError(errno.EIO, "Input/output error", str(Path(cache_dir) / "manifest.json"))
        return real_save(cache_dir, manifest)

    monkeypatch.setattr(pipeline, "save_manifest", failing_final_save)
    capsys.readouterr()
    assert extract_main(_extract_argv(target, dataset, cache)) == 2
    last_line = capsys.readouterr().err.splitlines()[-1]  # after the progress bars
    assert last_line == f"dflash-extract: error: {cache / 'manifest.json'}: Input/output error"
    monkeypatch.undo()  # the same command resumes: every shard is committed, only the manifest is written
    assert extract_main(_extract_argv(target, dataset, cache)) == 0
    with Cache.open(cache) as c:
        assert c.manifest.complete and len(c.shard_names) == len(committed_shard_names(cache))
