"""What a checkpoint's files hold, checked before anything is loaded: each JSON file an object whose fields
have the types and ranges a run writes, each safetensors file readable. A damaged or foreign value is one
`CheckpointError` line naming the file and the field (the CLIs print it as such), never a traceback."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from dflash.shards.safe_io import check_regular
from dflash.shards.safe_io import read_json as safe_read_json
from safetensors import SafetensorError, safe_open

STEP_DIR_RE = re.compile(r"^step_(\d{6,})$")

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
    match = STEP_DIR_RE.match(Path(ckpt).name)
    if match and int(match.group(1)) != step:
        raise CheckpointError(
            f"{path}: step {step} does not match its directory {Path(ckpt).name} (damaged checkpoint?)"
        )
    for key in ("config", "drafter", "cache_provenance"):
        if key in meta:
            json_object(meta[key], path, key)
    if meta.get("cache_shards") is not None:
        json_object(meta["cache_shards"], path, "cache_shards")
    for key in ("total_steps", "world_size"):
        if key in meta:
            json_int(meta[key], path, key, low=1)
    if "schedule_start" in meta:
        json_int(meta["schedule_start"], path, "schedule_start")
    if not isinstance(meta.get("finished", False), bool):
        raise CheckpointError(f"{path}: finished must be true or false")
    json_number(meta.get("best_walk"), path, "best_walk", optional=True)
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


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's safetensors file; a damaged file is one CheckpointError naming it."""
    check_regular(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except (SafetensorError, ValueError, RuntimeError) as exc:  # an OSError (I/O) propagates as such
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({detail}); damaged checkpoint?"
        ) from None


def read_json(path: str | Path) -> Any:
    return safe_read_json(path, max_bytes=256 << 20)  # depth-limited; special files refused
