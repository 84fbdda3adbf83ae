"""Training checkpoints: `RUN/checkpoints/step_{:06d}/`, safetensors + JSON only, committed atomically.

Layout of one checkpoint directory:

    model.safetensors       drafter parameters (fp32 master weights)
    optimizer.safetensors   optimizer state tensors, flattened as `{param_name}/{key}`
    optimizer.json          param groups (hyper-parameters, parameter names) and non-tensor state
    rng.safetensors         torch CPU/CUDA generator states (uint8), numpy/python MT states (int64)
    rng.json                the scalar parts of the numpy/python states
    loader.json             the data position (`StreamingLoader.state_dict()`)
    meta.json               step, flat config, manifest hash, schedule length, eval summary

A checkpoint is written into a hidden temp directory, every file fsynced, then renamed into place:
it is either complete or absent. Nothing here unpickles anything. What each file holds is checked before
anything is loaded (`checkpoint_files.py`); optimizer and RNG states are flattened in `train_state.py`.
"""

from __future__ import annotations

import errno
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from dflash.shards.atomic import commit_dir, fresh_temp_dir, restore_parked_dir
from dflash.shards.errors import DiskFull, ShardError
from dflash.shards.tensor_io import save_tensors

from .checkpoint_files import (
    LOADER_FIELDS,
    STEP_DIR_RE,
    CheckpointError,
    check_loader_state,
    read_json,
    read_meta,
    read_tensors,
)
from .train_state import optimizer_from_flat, optimizer_to_flat, rng_from_flat, rng_to_flat

CHECKPOINT_DIR = "checkpoints"
BEST_DIR = "best"
_FILES = (
    "model.safetensors",
    "optimizer.safetensors",
    "optimizer.json",
    "rng.safetensors",
    "rng.json",
    "loader.json",
    "meta.json",
)


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


# --- writing -----------------------------------------------------------------------------------------


def _write_json(path: Path, obj: Any) -> None:
    """A file inside a checkpoint's temp directory (`commit_dir` fsyncs it with the rest)."""
    path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")


def save_checkpoint(
    final: str | Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    param_names: Sequence[str],
    loader_state: dict[str, Any],
    meta: dict[str, Any],
    weights_only: bool = False,
) -> Path:
    """Write a checkpoint directory at `final` (e.g. RUN/checkpoints/step_000100) atomically.

    `weights_only` writes model.safetensors + meta.json (RUN/best: exportable, not resumable).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = fresh_temp_dir(final)  # a link planted under the temp name is removed, never followed
    try:
        weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        save_tensors(weights, tmp / "model.safetensors", metadata={"step": str(step)})
        _write_json(tmp / "meta.json", {**meta, "step": step, "weights_only": weights_only})
        if weights_only:
            commit_dir(tmp, final)
            return final
        opt_tensors, opt_structure = optimizer_to_flat(optimizer, param_names)
        save_tensors(opt_tensors, tmp / "optimizer.safetensors")
        _write_json(tmp / "optimizer.json", opt_structure)
        rng_tensors, rng_scalars = rng_to_flat()
        save_tensors(rng_tensors, tmp / "rng.safetensors")
        _write_json(tmp / "rng.json", rng_scalars)
        _write_json(tmp / "loader.json", loader_state)
        commit_dir(tmp, final)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        run_dir = final.parent.parent if final.parent.name == CHECKPOINT_DIR else final.parent
        kept = [p.name for _, p in list_checkpoints(run_dir) if p != final]
        raise DiskFull(
            f"{final}: no space left on device while writing this checkpoint; it was not written, and the "
            f"checkpoints committed before are intact ({', '.join(kept[-3:]) or 'none yet'}): free space, "
            "then continue with --resume"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def check_complete(ckpt: Path) -> None:
    missing = [name for name in _FILES if not (ckpt / name).is_file()]
    if missing:
        raise CheckpointError(f"{ckpt} is not a complete checkpoint: missing {', '.join(missing)}")


def read_resumable(ckpt: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(meta, loader position) of a checkpoint a run can resume from: complete, its meta.json holding what a
    resume reads, its loader.json a data position a run writes."""
    check_complete(ckpt)
    meta = read_meta(ckpt, require=("config", "total_steps", "cache_provenance"))
    path = ckpt / "loader.json"
    position = check_loader_state(read_json(path), path, meta["config"].get("epochs"), require=LOADER_FIELDS)
    return meta, position


def checkpoint_damage(ckpt: Path) -> str | None:
    """Why `ckpt` cannot be resumed from (a file missing, unreadable or holding what no run writes), or None:
    every file read and checked as a resume would, without loading anything into a model."""
    try:
        read_resumable(ckpt)
        for name in ("optimizer.json", "rng.json"):
            read_json(ckpt / name)
        for name in ("model.safetensors", "optimizer.safetensors", "rng.safetensors"):
            read_tensors(ckpt / name)
    except (CheckpointError, ShardError, OSError) as exc:
        return str(exc)
    return None


def older_intact_hint(run_dir: str | Path, damaged: Path) -> str:
    """For a refusal of the damaged `damaged`: the newest intact checkpoint before it and how to resume."""
    match = STEP_DIR_RE.match(damaged.name)
    newest = int(match.group(1)) if match else -1
    older = [path for step, path in reversed(list_checkpoints(run_dir)) if step < newest]
    for path in older:
        if checkpoint_damage(path) is None:
            return (
                f"; the newest intact checkpoint before it is {path.name}: continue from it with "
                f"--resume-from {path}"
            )
    return "; no older checkpoint is intact: start a new --out" if older else "; it is the only checkpoint"


def load_checkpoint(
    ckpt: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    param_names: Sequence[str],
    restore_rng: bool = True,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load model (+ optimizer, + global RNGs) in place; return (meta, loader_state)."""
    ckpt = Path(ckpt)
    check_complete(ckpt)
    meta = read_meta(ckpt)
    loader_path = ckpt / "loader.json"
    epochs = meta.get("config", {}).get("epochs")
    loader_state = check_loader_state(read_json(loader_path), loader_path, epochs)
    load_state(ckpt, model=model, optimizer=optimizer, param_names=param_names, restore_rng=restore_rng)
    return meta, loader_state


def load_state(
    ckpt: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    param_names: Sequence[str],
    restore_rng: bool = True,
) -> None:
    """The checkpoint's tensors in place: model weights (+ optimizer, + global RNGs). Its meta.json and
    loader.json are the caller's to read and check (`read_resumable`), once."""
    load_weights(model, ckpt / "model.safetensors")
    if optimizer is not None:
        optimizer_from_flat(
            optimizer,
            param_names,
            read_tensors(ckpt / "optimizer.safetensors"),
            read_json(ckpt / "optimizer.json"),
            ckpt / "optimizer",
        )
    if restore_rng:
        rng_from_flat(read_tensors(ckpt / "rng.safetensors"), read_json(ckpt / "rng.json"), ckpt / "rng")


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """model.safetensors into `model`: every parameter present, of its shape, finite."""
    weights = read_tensors(path)
    own = model.state_dict()
    for name, value in weights.items():
        ref = own.get(name)
        if ref is not None and tuple(value.shape) != tuple(ref.shape):
            raise CheckpointError(
                f"{path}: {name} has shape {tuple(value.shape)}, the drafter's is {tuple(ref.shape)}"
            )
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise CheckpointError(f"{path}: {name} holds non-finite values (damaged checkpoint?)")
    missing, unexpected = sorted(own.keys() - weights.keys()), sorted(weights.keys() - own.keys())
    if missing or unexpected:  # checked before loading: a refused file leaves the model as it was
        raise CheckpointError(
            f"{path}: weights do not match the drafter: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    model.load_state_dict(weights)


# --- finding and pruning -------------------------------------------------------------------------


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Committed checkpoints, oldest first (temp and half-replaced directories are ignored)."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR_RE.match(child.name)
        if match and child.is_dir() and (child / "meta.json").is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def clean_interrupted_saves(run_dir: str | Path) -> list[str]:
    """After a crash: drop half-written temp dirs, restore a checkpoint caught mid-replacement."""
    run_dir = Path(run_dir)
    actions = []
    for root in (run_dir / CHECKPOINT_DIR, run_dir):
        if not root.is_dir():
            continue
        for child in root.iterdir():
            if not child.name.startswith("."):
                continue
            if ".tmp-" in child.name and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
                actions.append(f"removed {child}")
            elif child.name.endswith(".old") and child.is_dir():
                restored = restore_parked_dir(child)
                if restored is not None:
                    actions.append(f"restored {restored}")
    return actions


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def resume_point(run_dir: str | Path, resume_from: str | None) -> Path | None:
    """The checkpoint a --resume continues from: `resume_from` (which must be one of `run_dir`'s committed
    checkpoints: another run's would mix two runs in one directory), else the latest; None when none."""
    if not resume_from:
        return latest_checkpoint(run_dir)
    wanted = Path(resume_from)
    for _, path in list_checkpoints(run_dir):
        if wanted.resolve() == path.resolve():
            return path
    raise ValueError(
        f"--resume-from {resume_from} is not a checkpoint of {run_dir} (one of {run_dir}/{CHECKPOINT_DIR}/"
        f"step_NNNNNN: {', '.join(p.name for _, p in list_checkpoints(run_dir)) or 'none yet'})"
    )


def find_checkpoint(run_dir: str | Path, *, step: int | None = None, best: bool = False) -> Path:
    """The checkpoint `dflash-train export` should read: a given step, the best one, or the latest."""
    run_dir = Path(run_dir)
    if best:
        path = run_dir / BEST_DIR
        if not (path / "meta.json").is_file():
            raise ValueError(f"{run_dir} has no best checkpoint yet (it is written at the first evaluation)")
        return path
    found = dict(list_checkpoints(run_dir))
    if not found:
        raise ValueError(
            f"{run_dir} has no checkpoints under {CHECKPOINT_DIR}/: is it a dflash-train run directory?"
        )
    if step is None:
        return found[max(found)]
    if step not in found:
        raise ValueError(f"{run_dir} has no checkpoint for step {step}; it has steps {sorted(found)}")
    return found[step]


def prune_checkpoints(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the `keep` newest checkpoints; return what was removed."""
    found = list_checkpoints(run_dir)
    removed = []
    for _, path in found[: max(0, len(found) - keep)]:
        shutil.rmtree(path)
        removed.append(path)
    return removed
