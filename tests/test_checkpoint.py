"""Checkpoints: safetensors + JSON only, atomic, and an exact round trip of every trajectory state."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from dflash.train import checkpoint as ckpt


def _model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[str]]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    names = [n for n, _ in model.named_parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt, names


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(n):
        x = torch.randn(16, 4, generator=g)
        loss = model(x).pow(2).mean() + torch.rand(1).item()  # global RNG use: must resume too
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _save(tmp: Path, step: int, model, opt, names, **meta) -> Path:
    return ckpt.save_checkpoint(
        tmp / "checkpoints" / ckpt.step_dir_name(step),
        step,
        model=model,
        optimizer=opt,
        param_names=names,
        loader_state={"epoch": 1, "next_index": 7},
        meta=meta,
    )


def test_round_trip_continues_the_same_trajectory(tmp_path: Path) -> None:
    model, opt, names = _model_and_optimizer()
    _steps(model, opt, 3, seed=1)
    torch.manual_seed(5)
    np.random.seed(6)
    random.seed(7)
    path = _save(tmp_path, 3, model, opt, names, note="x")
    expected = _steps(model, opt, 4, seed=2), np.random.rand(), random.random()

    model2, opt2, names2 = _model_and_optimizer(seed=99)  # different init: everything must come from disk
    torch.manual_seed(0)
    meta, loader_state = ckpt.load_checkpoint(path, model=model2, optimizer=opt2, param_names=names2)
    got = _steps(model2, opt2, 4, seed=2), np.random.rand(), random.random()
    assert got == expected  # bit for bit
    assert meta["step"] == 3 and meta["note"] == "x" and loader_state == {"epoch": 1, "next_index": 7}


def test_only_safetensors_and_json(tmp_path: Path) -> None:
    model, opt, names = _model_and_optimizer()
    _steps(model, opt, 1, seed=0)
    path = _save(tmp_path, 1, model, opt, names)
    suffixes = {p.suffix for p in path.iterdir()}
    assert suffixes == {".safetensors", ".json"}
    for p in path.glob("*.safetensors"):
        assert b"\x80\x04" not in p.read_bytes()[:16]  # not a pickle stream


def test_failed_save_leaves_nothing_and_keeps_the_old_copy(tmp_path: Path, monkeypatch) -> None:
    model, opt, names = _model_and_optimizer()
    first = _save(tmp_path, 5, model, opt, names, version=1)

    def boom(*args, **kwargs):
        raise OSError("disk on fire")

    monkeypatch.setattr(ckpt, "_write_json", boom)
    with pytest.raises(OSError):
        _save(tmp_path, 5, model, opt, names, version=2)
    with pytest.raises(OSError):
        _save(tmp_path, 6, model, opt, names)
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000005"]
    assert ckpt.read_json(first / "meta.json")["version"] == 1
    _save(tmp_path, 5, model, opt, names, version=3)  # replacing a committed checkpoint is atomic too
    assert ckpt.read_json(first / "meta.json")["version"] == 3


def test_find_list_and_prune(tmp_path: Path) -> None:
    model, opt, names = _model_and_optimizer()
    for step in (10, 20, 30):
        _save(tmp_path, step, model, opt, names)
    (tmp_path / "checkpoints" / ".step_000040.tmp-123").mkdir()  # a crashed save: ignored
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [10, 20, 30]
    assert ckpt.find_checkpoint(tmp_path).name == "step_000030"
    assert ckpt.find_checkpoint(tmp_path, step=20).name == "step_000020"
    with pytest.raises(ValueError, match="no checkpoint for step 25"):
        ckpt.find_checkpoint(tmp_path, step=25)
    with pytest.raises(ValueError, match="no best checkpoint"):
        ckpt.find_checkpoint(tmp_path, best=True)
    ckpt.prune_checkpoints(tmp_path, keep=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [20, 30]


def test_mismatched_model_is_refused(tmp_path: Path) -> None:
    model, opt, names = _model_and_optimizer()
    path = _save(tmp_path, 1, model, opt, names)
    other = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match="do not match"):
        ckpt.load_checkpoint(path, model=other, optimizer=None, param_names=["weight", "bias"])
    (path / "rng.json").unlink()
    with pytest.raises(ValueError, match=r"missing rng\.json"):
        ckpt.load_checkpoint(path, model=model, optimizer=opt, param_names=names)


def test_interrupted_saves_are_cleaned_or_restored(tmp_path: Path) -> None:
    model, opt, names = _model_and_optimizer()
    path = _save(tmp_path, 10, model, opt, names)
    (tmp_path / "checkpoints" / ".step_000020.tmp-999").mkdir()  # killed while writing
    path.rename(path.with_name(".step_000010.old"))  # killed between the two renames of a replacement
    assert ckpt.list_checkpoints(tmp_path) == []
    actions = ckpt.clean_interrupted_saves(tmp_path)
    assert len(actions) == 2
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [10]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000010"]


def test_weights_missing_a_parameter_are_refused_before_any_is_loaded(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model, _, _ = _model_and_optimizer(seed=0)
    donor, _, _ = _model_and_optimizer(seed=1)
    weights = {k: v.clone() for k, v in donor.state_dict().items() if k != "2.bias"}
    path = tmp_path / "model.safetensors"
    save_file(weights, str(path))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ckpt.CheckpointError, match=r"missing \['2\.bias'\]"):
        ckpt.load_weights(model, path)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # not half loaded
