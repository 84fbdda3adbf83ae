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
import math
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
from dflash.shards.safe_io import check_regular
from dflash.shards.safe_io import read_json as safe_read_json
from safetensors import SafetensorError, safe_open
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


# --- checking what a checkpoint's files hold ------------------------------------------------------------

_MAX_INT = 2**63 - 1


class CheckpointError(ValueError):
    """A checkpoint file that is damaged or holds values no run writes: one line naming file and field."""


def _json_kind(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return {int: "a number", float: "a number", str: "a string", list: "a list"}.get(type(value), "a value")


def json_object(value: Any, path: str | Path, field: str = "") -> dict[str, Any]:
    if not isinstance(value, dict):
        what = field or "the file"
        raise CheckpointError(
            f"{path}: {what} must be a JSON object, found {_json_kind(value)} (damaged checkpoint?)"
        )
    return value


def json_field(obj: dict[str, Any], key: str, path: str | Path, prefix: str = "") -> Any:
    if key not in obj:
        raise CheckpointError(f"{path}: missing field {prefix}{key!r} (damaged checkpoint?)")
    return obj[key]


def json_int(value: Any, path: str | Path, field: str, *, low: int = 0, high: int = _MAX_INT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        if high == _MAX_INT:
            want = "a non-negative integer" if low == 0 else f"an integer >= {low}"
        else:
            want = f"an integer in [{low}, {high}]"
        raise CheckpointError(f"{path}: {field} must be {want}, found {value!r:.60}")
    return value


def json_number(value: Any, path: str | Path, field: str, *, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        kind = "a finite number or null" if optional else "a finite number"
        raise CheckpointError(f"{path}: {field} must be {kind}, found {value!r:.60}")
    return float(value)


def read_meta(ckpt: str | Path, require: Sequence[str] = ()) -> dict[str, Any]:
    """meta.json, checked: the fields a resume or an export uses have the types and ranges a run writes,
    `step` is the one its `step_NNNNNN` directory is named for, and the fields in `require` are present."""
    path = Path(ckpt) / "meta.json"
    meta = json_object(read_json(path), path)
    for key in ("step", *require):
        json_field(meta, key, path)
    step = json_int(meta["step"], path, "step")
    match = _STEP_RE.match(Path(ckpt).name)
    if match and int(match.group(1)) != step:
        raise CheckpointError(
            f"{path}: step {step} does not match its directory {Path(ckpt).name} (damaged checkpoint?)"
        )
    for key in ("config", "drafter", "cache_provenance"):
        if key in meta:
            json_object(meta[key], path, key)
    if meta.get("cache_shards") is not None:
        json_object(meta["cache_shards"], path, "cache_shards")
    if "total_steps" in meta:
        json_int(meta["total_steps"], path, "total_steps", low=1)
    json_number(meta.get("best_tau"), path, "best_tau", optional=True)
    epochs = meta.get("config", {}).get("epochs")
    if epochs is not None:
        json_int(epochs, path, "config.epochs", low=1)
    slot = meta.get("slot_weights")
    if slot is not None:
        json_object(slot, path, "slot_weights")
        for key in ("factors", "tally"):
            values = json_field(slot, key, path, "slot_weights.")
            if not isinstance(values, list):
                raise CheckpointError(f"{path}: slot_weights.{key} must be a list of numbers")
            for i, v in enumerate(values):
                json_number(v, path, f"slot_weights.{key}[{i}]")
    return meta


LOADER_FIELDS = ("epoch", "next_index", "skipped_samples")


def check_loader_state(
    state: Any, path: str | Path, epochs: int | None = None, require: Sequence[str] = ()
) -> dict[str, Any]:
    """loader.json, checked: a JSON object whose position fields are non-negative integers; `epoch` before
    `epochs` (the run that wrote it had that many); the fields in `require` present."""
    state = json_object(state, path)
    for key in require:
        json_field(state, key, path)
    for key in LOADER_FIELDS:
        if key in state:
            json_int(state[key], path, key)
    if "seed" in state:
        json_int(state["seed"], path, "seed", low=-_MAX_INT, high=_MAX_INT - 1)
    if "world_size" in state:
        json_int(state["world_size"], path, "world_size", low=1)
    if epochs is not None and state.get("epoch", 0) >= epochs:
        raise CheckpointError(
            f"{path}: epoch {state['epoch']} is past the {epochs} epoch(s) of the run that wrote it"
        )
    return state


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
    where: str | Path = "optimizer",
) -> None:
    """Inverse of `optimizer_to_flat`: load the state into an optimizer built over the same names.

    `where` names the files in errors; the state is checked first (group fields of the live optimizer's
    types, every parameter's state tensors float32 of its shape, finite, step counts >= 0)."""
    index = {name: i for i, name in enumerate(param_names)}
    _check_optimizer(optimizer, param_names, tensors, structure, where)
    saved_names = [n for g in structure["param_groups"] for n in g["params"]]
    if sorted(saved_names) != sorted(param_names):
        missing = sorted(set(param_names) - set(saved_names))[:3]
        extra = sorted(set(saved_names) - set(param_names))[:3]
        raise CheckpointError(
            f"{where}.json: optimizer does not match the model: missing {missing}, unexpected {extra}"
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
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"{where}.json: optimizer state does not load ({exc})") from None


_ADAM_TENSORS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")


def _check_optimizer(
    optimizer: torch.optim.Optimizer,
    param_names: Sequence[str],
    tensors: dict[str, torch.Tensor],
    structure: Any,
    where: str | Path,
) -> None:
    js, st = f"{where}.json", f"{where}.safetensors"
    structure = json_object(structure, js)
    groups = json_field(structure, "param_groups", js)
    live = optimizer.param_groups
    if not isinstance(groups, list) or len(groups) != len(live):
        raise CheckpointError(f"{js}: param_groups must be a list of {len(live)} group(s)")
    for g, (group, ref) in enumerate(zip(groups, live, strict=True)):
        group = json_object(group, js, f"param_groups[{g}]")
        params = json_field(group, "params", js, f"param_groups[{g}].")
        if not isinstance(params, list) or not all(isinstance(n, str) for n in params):
            raise CheckpointError(f"{js}: param_groups[{g}].params must be a list of parameter names")
        for key, value in group.items():
            if key == "params" or key not in ref:
                continue
            field, want = f"param_groups[{g}].{key}", ref[key]
            if isinstance(want, bool) or want is None:  # flags (foreach, fused, ...): a bool or null
                if value is not None and not isinstance(value, bool):
                    raise CheckpointError(f"{js}: {field} must be true, false or null, found {value!r:.60}")
            elif isinstance(want, (int, float)):
                json_number(value, js, field)
            elif isinstance(want, (tuple, list)):
                if not isinstance(value, list) or len(value) != len(want):
                    raise CheckpointError(
                        f"{js}: {field} must be a list of {len(want)} numbers, found {value!r:.60}"
                    )
                for i, v in enumerate(value):
                    json_number(v, js, f"{field}[{i}]")
    scalar_state = structure.get("scalar_state", {})
    json_object(scalar_state, js, "scalar_state")
    for name, extra in scalar_state.items():
        if name not in param_names:
            raise CheckpointError(f"{js}: scalar_state names an unknown parameter {name!r:.80}")
        extra = json_object(extra, js, f"scalar_state[{name!r}]")
        clash = sorted(set(extra) & set(_ADAM_TENSORS))
        if clash:
            raise CheckpointError(f"{js}: scalar_state[{name!r}] holds {clash[0]!r}, a tensor entry")
    named = dict(zip(param_names, _ordered_params(optimizer), strict=False))
    for flat_key, value in tensors.items():
        name, _, key = flat_key.rpartition("/")
        if name not in named or key not in _ADAM_TENSORS:
            raise CheckpointError(f"{st}: unexpected tensor {flat_key!r:.120}")
        param = named[name]
        if value.dtype != torch.float32:
            raise CheckpointError(f"{st}: {flat_key} has dtype {value.dtype}, expected torch.float32")
        shape = () if key == "step" else tuple(param.shape)
        if tuple(value.shape) != shape:
            raise CheckpointError(f"{st}: {flat_key} has shape {tuple(value.shape)}, expected {shape}")
        if not bool(torch.isfinite(value).all()):
            raise CheckpointError(f"{st}: {flat_key} holds non-finite values (damaged checkpoint?)")
        if key != "exp_avg" and bool((value < 0).any()):
            raise CheckpointError(f"{st}: {flat_key} holds negative values (damaged checkpoint?)")
    keys_of: dict[str, set[str]] = {}
    for flat_key in tensors:
        name, _, key = flat_key.rpartition("/")
        keys_of.setdefault(name, set()).add(key)
    for name, keys in keys_of.items():
        for need in ("exp_avg", "exp_avg_sq", "step"):
            if need not in keys:
                raise CheckpointError(f"{st}: no {name}/{need} although {name} has optimizer state")


def _ordered_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in `state_dict()` id order (ids number them across groups)."""
    return [p for g in optimizer.param_groups for p in g["params"]]


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


def _check_rng(tensors: dict[str, torch.Tensor], scalars: Any, where: str | Path) -> dict[str, Any]:
    js, st = f"{where}.json", f"{where}.safetensors"
    shapes = {
        "torch_cpu": (torch.uint8, tuple(torch.get_rng_state().shape)),
        "numpy_keys": (torch.int64, (624,)),
        "python_state": (torch.int64, (625,)),
    }
    for key, (dtype, shape) in shapes.items():
        value = tensors.get(key)
        if value is None:
            raise CheckpointError(f"{st}: missing tensor {key!r} (damaged checkpoint?)")
        if value.dtype != dtype or tuple(value.shape) != shape:
            raise CheckpointError(
                f"{st}: {key} is {value.dtype} {tuple(value.shape)}, expected {dtype} {shape}"
            )
    scalars = json_object(scalars, js)
    np_s = json_object(json_field(scalars, "numpy", js), js, "numpy")
    if json_field(np_s, "kind", js, "numpy.") != "MT19937":
        raise CheckpointError(f"{js}: numpy.kind must be 'MT19937', found {np_s['kind']!r:.60}")
    json_int(json_field(np_s, "pos", js, "numpy."), js, "numpy.pos", high=624)
    json_int(json_field(np_s, "has_gauss", js, "numpy."), js, "numpy.has_gauss", high=1)
    json_number(json_field(np_s, "cached_gaussian", js, "numpy."), js, "numpy.cached_gaussian")
    py_s = json_object(json_field(scalars, "python", js), js, "python")
    json_int(json_field(py_s, "version", js, "python."), js, "python.version", low=1, high=100)
    json_number(json_field(py_s, "gauss_next", js, "python."), js, "python.gauss_next", optional=True)
    return scalars


def rng_from_flat(
    tensors: dict[str, torch.Tensor], scalars: dict[str, Any], where: str | Path = "rng"
) -> None:
    """Restore the generators `rng_to_flat` saved; `where` (RUN/.../rng) names the files in errors."""
    _check_rng(tensors, scalars, where)
    try:
        _set_rng(tensors, scalars)
    except (ValueError, TypeError, RuntimeError, OverflowError) as exc:
        raise CheckpointError(f"{where}.safetensors: generator state does not load ({exc})") from None


def _set_rng(tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> None:
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
    """Every tensor of a checkpoint's safetensors file; a damaged file is one CheckpointError naming it."""
    check_regular(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except (SafetensorError, ValueError, RuntimeError, OSError) as exc:
        if isinstance(exc, OSError) and not isinstance(exc, SafetensorError):
            raise
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({detail}); damaged checkpoint?"
        ) from None


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
    meta = read_meta(ckpt)
    loader_path = ckpt / "loader.json"
    epochs = meta.get("config", {}).get("epochs")
    loader_state = check_loader_state(read_json(loader_path), loader_path, epochs)
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
    return meta, loader_state


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
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not match the drafter: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )


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
    for key in ("config", "cache_provenance"):
        if not isinstance(saved.get(key), dict):
            raise CheckpointError(f"checkpoint meta.json: {key} must be a JSON object")
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
