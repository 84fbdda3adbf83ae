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
it is either complete or absent. Nothing here unpickles anything.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from dflash.shards import Manifest, diff_manifests
from dflash.shards.atomic import commit_dir, fresh_temp_dir, restore_parked_dir
from dflash.shards.errors import ManifestMismatch
from dflash.shards.manifest import PROVENANCE_FIELDS, canonical_json
from dflash.shards.safe_io import read_json as safe_read_json
from safetensors import safe_open
from safetensors.torch import save_file

from .config import TrainConfig

CHECKPOINT_DIR = "checkpoints"
BEST_DIR = "best"
_STEP_RE = re.compile(r"^step_(\d{6,})$")
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


# --- optimizer state <-> flat tensors + JSON -----------------------------------------------------


def optimizer_to_flat(
    optimizer: torch.optim.Optimizer, param_names: Sequence[str]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Flatten `optimizer.state_dict()` by parameter name; `param_names[i]` names parameter id i."""
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, per_param in state["state"].items():
        name = param_names[pid]
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}/{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(name, {})[key] = value
    groups = []
    for group in state["param_groups"]:
        plain = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        plain["params"] = [param_names[i] for i in group["params"]]
        groups.append(plain)
    return tensors, {"param_groups": groups, "scalar_state": scalars}


def optimizer_from_flat(
    optimizer: torch.optim.Optimizer,
    param_names: Sequence[str],
    tensors: dict[str, torch.Tensor],
    structure: dict[str, Any],
) -> None:
    """Inverse of `optimizer_to_flat`: load the state into an optimizer built over the same names."""
    index = {name: i for i, name in enumerate(param_names)}
    saved_names = [n for g in structure["param_groups"] for n in g["params"]]
    if sorted(saved_names) != sorted(param_names):
        missing = sorted(set(param_names) - set(saved_names))[:3]
        extra = sorted(set(saved_names) - set(param_names))[:3]
        raise ValueError(
            f"checkpoint optimizer does not match the model: missing {missing}, unexpected {extra}"
        )
    state: dict[int, dict[str, Any]] = {}
    for flat_key, value in tensors.items():
        name, _, key = flat_key.rpartition("/")
        state.setdefault(index[name], {})[key] = value
    for name, extra_state in structure.get("scalar_state", {}).items():
        state.setdefault(index[name], {}).update(extra_state)
    groups = []
    for group in structure["param_groups"]:
        restored = {k: (tuple(v) if k == "betas" else v) for k, v in group.items() if k != "params"}
        restored["params"] = [index[n] for n in group["params"]]
        groups.append(restored)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# --- RNG states ----------------------------------------------------------------------------------


def rng_to_flat() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every global generator the run touches, as tensors plus JSON scalars."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["numpy_keys"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    version, py_state, gauss_next = random.getstate()
    tensors["python_state"] = torch.tensor(py_state, dtype=torch.int64)
    scalars = {
        "numpy": {
            "kind": kind,
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {"version": version, "gauss_next": gauss_next},
    }
    return tensors, scalars


def rng_from_flat(tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("torch_cuda_"))]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    np_s = scalars["numpy"]
    keys = tensors["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state((np_s["kind"], keys, np_s["pos"], np_s["has_gauss"], np_s["cached_gaussian"]))
    py_s = scalars["python"]
    random.setstate(
        (py_s["version"], tuple(int(v) for v in tensors["python_state"].tolist()), py_s["gauss_next"])
    )


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
        save_file(weights, str(tmp / "model.safetensors"), metadata={"step": str(step)})
        _write_json(tmp / "meta.json", {**meta, "step": step, "weights_only": weights_only})
        if weights_only:
            commit_dir(tmp, final)
            return final
        opt_tensors, opt_structure = optimizer_to_flat(optimizer, param_names)
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        _write_json(tmp / "optimizer.json", opt_structure)
        rng_tensors, rng_scalars = rng_to_flat()
        save_file(rng_tensors, str(tmp / "rng.safetensors"))
        _write_json(tmp / "rng.json", rng_scalars)
        _write_json(tmp / "loader.json", loader_state)
        commit_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


def read_json(path: str | Path) -> Any:
    return safe_read_json(path, max_bytes=256 << 20)  # depth-limited; special files refused


def check_complete(ckpt: Path) -> None:
    missing = [name for name in _FILES if not (ckpt / name).is_file()]
    if missing:
        raise ValueError(f"{ckpt} is not a complete checkpoint: missing {', '.join(missing)}")


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
    weights = read_tensors(ckpt / "model.safetensors")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{ckpt}: weights do not match the drafter: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    if optimizer is not None:
        optimizer_from_flat(
            optimizer,
            param_names,
            read_tensors(ckpt / "optimizer.safetensors"),
            read_json(ckpt / "optimizer.json"),
        )
    if restore_rng:
        rng_from_flat(read_tensors(ckpt / "rng.safetensors"), read_json(ckpt / "rng.json"))
    return read_json(ckpt / "meta.json"), read_json(ckpt / "loader.json")


# --- resume checks -------------------------------------------------------------------------------------

# Settings a resume may change: they do not alter the trajectory (or only extend it).
RESUMABLE_KEYS = frozenset(
    {
        "cache",
        "out",
        "resume",
        "device",
        "attention",  # a kernel choice: both paths compute the same function
        "compile",  # likewise
        "eval_every",
        "save_every",
        "log_every",
        "keep_checkpoints",
        "tensorboard",
        "plots",
        "progress",
        "loader_threads",
        "prefetch_batches",
        "max_steps",
        "epochs",
        "eval_samples",
    }
)


def manifest_digest(manifest: Manifest) -> str:
    """sha256 of what a run trains on: the cache's provenance and every shard's index checksum."""
    d = manifest.to_dict()
    keep = {k: d[k] for k in PROVENANCE_FIELDS} | {"shards": sorted(shard_checksums(manifest).items())}
    return hashlib.sha256(canonical_json(keep)).hexdigest()


def shard_checksums(manifest: Manifest) -> dict[str, str]:
    return {s.name: s.index_checksum for s in manifest.shards}


def cache_identity(manifest: Manifest) -> dict[str, Any]:
    """The meta.json entries a resume compares with the cache it is given (`check_resume`)."""
    d = manifest.to_dict()
    return {
        "manifest_sha256": manifest_digest(manifest),
        "cache_provenance": {k: d[k] for k in PROVENANCE_FIELDS},
        "cache_shards": shard_checksums(manifest),
    }


def check_resume(saved: dict[str, Any], cfg_flat: dict[str, Any], manifest: Manifest) -> None:
    """Refuse a resume that would change the trajectory: other settings, or another cache (provenance,
    or any shard added, removed or rewritten since the checkpoint), naming what differs."""
    now = cfg_flat
    # A setting added since the checkpoint was written trained it at its default.
    then = {**TrainConfig(cache="cache", out="run").to_flat(), **saved["config"]}
    changed = [
        f"{k}: {then.get(k)!r} (checkpoint) != {now[k]!r}"
        for k in sorted(now)
        if k not in RESUMABLE_KEYS and then.get(k) != now[k]
    ]
    if changed:
        raise ValueError(
            f"--resume with settings that change the trajectory: {'; '.join(changed)}; "
            "use the checkpoint's settings or start a new --out"
        )
    diffs = diff_manifests(saved["cache_provenance"], manifest.to_dict())
    if diffs:
        raise ManifestMismatch("--resume against a different cache", diffs)
    if saved.get("manifest_sha256") != manifest_digest(manifest):
        before, after = saved.get("cache_shards") or {}, shard_checksums(manifest)
        shards = [
            f"{name}: {before.get(name, 'absent')} (checkpoint) != {after.get(name, 'absent')}"
            for name in sorted(set(before) | set(after))
            if before.get(name) != after.get(name)
        ]
        raise ManifestMismatch(
            "--resume against a cache whose shards changed since the checkpoint",
            shards
            or [
                f"manifest_sha256: {saved.get('manifest_sha256')} (checkpoint) != {manifest_digest(manifest)}"
            ],
        )


# --- finding and pruning -------------------------------------------------------------------------


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Committed checkpoints, oldest first (temp and half-replaced directories are ignored)."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_RE.match(child.name)
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
