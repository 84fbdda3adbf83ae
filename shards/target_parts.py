"""`CACHE/target/`: the frozen target parts training needs, so `dflash-train` never opens the target.

    CACHE/target/config.json          the target's config.json, byte for byte
    CACHE/target/frozen.safetensors   embed_tokens.weight [V, H] and lm_head.weight [V, H] (bf16);
                                      a tied target (`tie_word_embeddings: true`) stores no lm_head.weight;
                                      final_norm.gain [H] (fp32): the final RMSNorm's effective per-channel
                                      gain (its weight, or 1 + weight where the model centres it at zero),
                                      so training can turn the cached last layer into the target's logits
                                      (distillation); caches written before it have none
    CACHE/target/<tokenizer files>    tokenizer, chat-template and generation files the target has

A tied target (Qwen3-0.6B/1.7B/4B) keeps ONE matrix, as its checkpoint does: safetensors refuses two
names for one tensor, and a second copy would cost every training GPU another [V, H] matrix. The reader
returns the same tensor as embedding and lm_head. Caches written before this rule (both names stored)
read as they are.

One writer (`write_target_parts`, extraction) and one reader (`read_target_parts`, training): the
directory is built beside its final name and swapped in whole, then checked by the reader's own
checks (`check_target_parts`), so a bad part fails the extraction before its first batch. The writer
returns each file's digest for the manifest (`target_files.py`), and keeps an existing directory only
when those digests vouch for it.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .atomic import commit_dir, fresh_temp_dir
from .errors import DiskFull, ShardError
from .paths import TARGET_DIR
from .safe_io import check_regular
from .target_config import CONFIG_NAME, TargetConfig, read_target_config
from .target_files import digest_files, target_file_problems
from .tensor_io import save_tensors

log = logging.getLogger(__name__)

FROZEN_NAME = "frozen.safetensors"
EMBED_KEY = "embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"
FINAL_NORM_KEY = "final_norm.gain"
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")  # safetensors' names; fp8 or integer tables are refused
# Tokenizer, chat template and generation defaults: small files a drafter export or a demo may need.
EXTRA_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


@dataclass(frozen=True, slots=True)
class TargetParts:
    """What CACHE/target/ holds; `lm_head is embed` for a tied target."""

    directory: Path
    config: TargetConfig
    embed: torch.Tensor
    lm_head: torch.Tensor
    final_norm_gain: torch.Tensor | None = None  # [H] fp32; None in caches written before it was stored

    @property
    def tied(self) -> bool:
        return self.lm_head is self.embed


def target_dir(cache_dir: str | os.PathLike) -> Path:
    return Path(cache_dir) / TARGET_DIR


def write_target_parts(
    cache_dir: str | os.PathLike,
    *,
    config_bytes: bytes,
    frozen: Callable[[], Mapping[str, torch.Tensor]],
    extra_files: Mapping[str, Path],
    source: str,
    recorded: Mapping[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Write CACHE/target/, check it and return its files' digests (the manifest's `target_files`). One
    that holds the same config.json and matches `recorded` (the manifest's digests) is kept as it is (and
    checked), so `frozen()` -> {EMBED_KEY: ..., LM_HEAD_KEY unless tied, FINAL_NORM_KEY when known} reads the
    weights only when they are written; one without the final norm's gain (written before it was stored) is
    written again to add it; one nothing vouches for (no digests: an older cache, or a crash before they were recorded)
    or that differs from them (damaged since) is written again. Every failure is one line naming the file."""
    final = target_dir(cache_dir)
    if (final / CONFIG_NAME).is_file() and (final / FROZEN_NAME).is_file():
        if (final / CONFIG_NAME).read_bytes() != config_bytes:
            log.warning("%s holds another target's parts; replacing them", final)
        elif recorded:
            damaged = target_file_problems(final, recorded)
            if damaged:
                log.warning(
                    "%s: %s differ from the manifest's record; rewriting them", final, ", ".join(damaged)
                )
            elif FINAL_NORM_KEY not in _shapes(final / FROZEN_NAME):
                log.info("%s: adding the final norm's gain (distillation needs it)", final)
            else:
                check_target_parts(cache_dir)
                return dict(recorded)
    unknown = sorted(set(extra_files) - set(EXTRA_FILES))
    if unknown:
        raise ValueError(f"not target part names: {unknown} (known: {', '.join(EXTRA_FILES)})")
    tmp = fresh_temp_dir(final)  # a link planted under the temp name is removed, never followed
    try:
        (tmp / CONFIG_NAME).write_bytes(config_bytes)
        tensors = {name: t.contiguous() for name, t in frozen().items()}
        _save_frozen(tensors, tmp / FROZEN_NAME, final / FROZEN_NAME, source)
        for name, path in extra_files.items():
            shutil.copyfile(path, tmp / name)
        commit_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    check_target_parts(cache_dir)
    return digest_files(final)  # read back from disk: the record is of what is there


def _save_frozen(tensors: dict[str, torch.Tensor], path: Path, final: Path, source: str) -> None:
    """`save_tensors`, a full disk said with what is kept (its other failures already name the file)."""
    try:
        save_tensors(tensors, path, metadata={"source": source})
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(
                f"{final}: no space left on device while writing the target's frozen parts; committed work "
                "is intact, free space and re-run the same command to resume"
            ) from None
        raise


def stale_target_dirs(cache_dir: str | os.PathLike) -> list[Path]:
    """Temp directories left by a killed writer (the caller removes them while no writer runs)."""
    return sorted(Path(cache_dir).glob(f".{TARGET_DIR}.tmp-*"))


def _shapes(path: Path) -> dict[str, tuple[list[int], str]]:
    """name -> (shape, dtype) from the safetensors header only."""
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{path} is missing: is {path.parent.parent} a complete dflash cache?")
    check_regular(path)  # safetensors would block on a FIFO
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {k: (list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118
    except Exception as exc:  # safetensors raises its own error types for malformed files
        raise ShardError(f"{path}: unreadable safetensors file ({str(exc).splitlines()[0]})") from None


def check_target_parts(cache_dir: str | os.PathLike) -> TargetConfig:
    """Refuse, in one line naming the file, a CACHE/target/ training could not use: a config.json that is
    not a decoder's, a missing embedding, a missing lm_head on an untied target, a tensor that is not a
    float of 16 bits or more, or [V, H] shapes that disagree with the config. Reads headers only (no tensor
    data); the values (finite) are checked by training (`dflash.train.guards`)."""
    directory = target_dir(cache_dir)
    config_path, frozen_path = directory / CONFIG_NAME, directory / FROZEN_NAME
    if not os.path.lexists(config_path):  # a FIFO or directory is refused by the reader, in one line
        raise FileNotFoundError(f"{config_path} is missing: is {cache_dir} a complete dflash cache?")
    try:
        config = read_target_config(config_path)
    except ValueError as exc:
        raise ShardError(str(exc)) from None
    shapes = _shapes(frozen_path)
    wanted = [EMBED_KEY] if config.tie_word_embeddings else [EMBED_KEY, LM_HEAD_KEY]
    missing = [k for k in wanted if k not in shapes]
    if missing:
        raise ShardError(
            f"{frozen_path}: missing tensors {missing} (has {sorted(shapes)}; config.json "
            f"tie_word_embeddings={config.tie_word_embeddings})"
        )
    expected = [config.vocab_size, config.hidden_size]
    for key, (shape, dtype) in shapes.items():
        if key in (EMBED_KEY, LM_HEAD_KEY) and dtype not in FLOAT_DTYPES:
            raise ShardError(f"{frozen_path}: {key} is {dtype}, not a float of 16 bits or more")
        if key in (EMBED_KEY, LM_HEAD_KEY) and shape != expected:
            raise ShardError(
                f"{frozen_path}: {key} is {shape}, config.json says [vocab_size, hidden_size] = {expected}"
            )
        if key == FINAL_NORM_KEY and (shape != [config.hidden_size] or dtype not in FLOAT_DTYPES):
            raise ShardError(
                f"{frozen_path}: {key} is {dtype} {shape}, not a float vector of hidden_size "
                f"{config.hidden_size}"
            )
    return config


def read_target_parts(cache_dir: str | os.PathLike) -> TargetParts:
    """CACHE/target/ checked and loaded (CPU tensors as stored)."""
    config = check_target_parts(cache_dir)
    directory = target_dir(cache_dir)
    with safe_open(str(directory / FROZEN_NAME), framework="pt", device="cpu") as f:
        embed = f.get_tensor(EMBED_KEY)
        keys = set(f.keys())
        lm_head = f.get_tensor(LM_HEAD_KEY) if LM_HEAD_KEY in keys else embed
        gain = f.get_tensor(FINAL_NORM_KEY).float() if FINAL_NORM_KEY in keys else None
    return TargetParts(directory=directory, config=config, embed=embed, lm_head=lm_head, final_norm_gain=gain)
