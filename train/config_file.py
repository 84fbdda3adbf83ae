"""A `--config` file for `dflash-train`: JSON or TOML of flat keys that mirror the flags, each known key's
value checked against its `TrainConfig` field's type as it is read, so a mistake is one line naming the key
and the file (unknown keys are named by `config.config_from_flat`)."""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any

from dflash.shards.errors import ShardError
from dflash.shards.safe_io import load_json, read_regular

from .config import SECTIONS, TrainConfig, flat_keys

MAX_CONFIG_BYTES = 16 << 20  # a --config file is a few flags: anything bigger is not one


def load_config_file(path: str | Path) -> dict[str, Any]:
    """A JSON or TOML file of flat keys that mirror the flags (`token_budget` or `token-budget`); each
    known key's value is checked against its field's type here, so a mistake names the key and the file."""
    path = Path(path)
    try:
        raw = read_regular(path, MAX_CONFIG_BYTES, "--config")  # refuses /dev/zero, FIFOs, directories
    except ShardError as exc:
        raise ValueError(str(exc)) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--config {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if path.suffix == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            raise ValueError(f"{path}: TOML config files need Python >= 3.11; use JSON instead") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: not valid TOML: {exc}") from None
    else:
        try:
            data = load_json(text, str(path))  # depth-limited
        except ShardError as exc:
            raise ValueError(str(exc)) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a table/object of flag names to values")
    types_of = _field_types()
    for key, value in data.items():
        name = key.replace("-", "_") if isinstance(key, str) else key
        if name in types_of:  # unknown keys are named by config_from_flat
            data[key] = _check_type(value, types_of[name], f"--config {path}: {key}")
    return data


def _field_types() -> dict[str, Any]:
    """Every flat key -> its annotation, resolved (the module uses postponed annotations)."""
    hints = typing.get_type_hints(TrainConfig)
    for cls in SECTIONS.values():
        hints.update(typing.get_type_hints(cls))
    return {name: hints[name] for name in flat_keys()}


def _type_name(hint: Any) -> str:
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return " or ".join(_type_name(a) for a in args)
    if typing.get_origin(hint) is tuple:
        return (
            f"a list of {'integers' if args[0] is int else _type_name(args[0])} or a comma-separated string"
        )
    return {
        bool: "true/false",
        int: "an integer",
        float: "a number",
        str: "a string",
        type(None): "null",
    }.get(hint, str(hint))


def _check_type(value: Any, hint: Any, where: str) -> Any:
    """`value` if it fits `hint` (ints become floats for float fields); else a ValueError naming `where`."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        if value is None and type(None) in typing.get_args(hint):
            return None
        for arm in typing.get_args(hint):
            if arm is not type(None):
                try:
                    return _check_type(value, arm, where)
                except ValueError:
                    pass
    elif hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63:
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
    elif typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        if isinstance(value, str):
            return value  # "1,9,17": parse_layer_ids reads it
        if isinstance(value, (list, tuple)):
            return [_check_type(v, item, where) for v in value]
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise ValueError(f"{where}={shown}: expected {_type_name(hint)}")
