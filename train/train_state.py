"""Optimizer and RNG state <-> flat tensors + JSON (safetensors and JSON only: nothing is unpickled), checked
against the live optimizer and the generators' formats before anything is loaded."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .checkpoint_files import CheckpointError, json_field, json_int, json_number, json_object

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
