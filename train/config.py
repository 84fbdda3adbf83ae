"""`TrainConfig` for `dflash-train`: one section per component, flat keys for flags and config files.

Each section is a kw-only dataclass that validates itself. Field names are unique across sections,
so a flat mapping (CLI flags, a JSON/TOML config file, `meta.json` of a checkpoint) resolves to a
section without a lookup table. Presets are plain functions returning a config.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dflash.shards.layers import check_layer_ids
from dflash.shards.urls import check_url, default_local_dir, is_url, local_path

from .data_plan import ORDERS

ON_CORRUPT_CHOICES = ("skip", "fail")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
ATTENTION_CHOICES = ("auto", "dense", "flex")  # see mask.choose_backend
SLOT_WEIGHT_CHOICES = ("decay", "reach")  # see slot_weights.py
REACH_FLOOR_GAMMA = 1.0  # `reach`'s floor decay when --gamma is not given (the CPU size's best fixed gamma)
MAX_SEED = 2**32 - 1  # numpy's and torch's seeding both accept 0..2**32-1


def default_gamma(block_size: int) -> float:
    """Loss decay for block position k (w_k = exp(-(k-1)/gamma)): the paper's 7 / 5 / 4 for B = 16 / 10 / 8,
    (B - 2) / 2 (at least 1) elsewhere. The one rule: the loader, evaluation and `blocks` all use it."""
    paper = {16: 7.0, 10: 5.0, 8: 4.0}
    return paper.get(block_size, max(1.0, (block_size - 2) / 2.0))


# `--early-stop`: end the run at an evaluation whose held-out walk is this far below the run's best (0: never).
# On the quality benchmark prose's walk fell 2.6-3.8% below its step-2000 peak by step 4000 of 6,278 on every
# seed, while no code or hybrid curve fell more than 0.15% from its best (BENCHMARKS.md, "--early-stop").
DEFAULT_EARLY_STOP = 0.02


@dataclass(kw_only=True, slots=True)
class LoaderConfig:
    """What the streaming loader reads and how it packs it."""

    token_budget: int = 8192
    max_length: int = 3072
    loader_threads: int = 4
    # processes that read and pack batches (`loader_procs.py`); 0: threads of the training process;
    # None: 4 on CUDA (the training thread then keeps the GIL to itself), threads on a CPU
    loader_workers: int | None = None
    prefetch_batches: int = 8
    shuffle_window: int = 1024
    # an epoch's order (`data_plan.py`): spans of the stored order, the same batches from any codec's cache of
    # one dataset; shards, the order of runs started before spans (2026-12-05)
    data_order: str = "spans"
    on_corrupt: str = "fail"
    eval_fraction: float = 0.01
    eval_rows: str | None = None
    eval_samples: int = 128
    shard_cache_dir: str | None = None  # an s3:// cache: its manifest, target/ and whole shards kept here
    shard_cache_gb: float = 0.0  # ... up to this many GB of shards (0: shards read by range requests only)

    def __post_init__(self) -> None:
        _positive("token_budget", self.token_budget)
        _positive("max_length", self.max_length)
        _positive("loader_threads", self.loader_threads)
        if self.loader_workers is not None and self.loader_workers < 0:
            raise ValueError(f"loader_workers={self.loader_workers}: must be >= 0")
        _positive("prefetch_batches", self.prefetch_batches)
        _positive("shuffle_window", self.shuffle_window)
        _positive("eval_samples", self.eval_samples)
        if self.token_budget < self.max_length:
            raise ValueError(
                f"token_budget={self.token_budget} is smaller than max_length={self.max_length}: "
                "a full-length sample would not fit one batch; raise --token-budget or lower --max-length"
            )
        if self.on_corrupt not in ON_CORRUPT_CHOICES:
            raise ValueError(f"on_corrupt={self.on_corrupt!r}: choose one of {', '.join(ON_CORRUPT_CHOICES)}")
        if self.data_order not in ORDERS:
            raise ValueError(f"data_order={self.data_order!r}: choose one of {', '.join(ORDERS)}")
        if not (isinstance(self.shard_cache_gb, (int, float)) and 0.0 <= self.shard_cache_gb < math.inf):
            raise ValueError(f"shard_cache_gb={self.shard_cache_gb!r}: must be a number of GB >= 0")
        if self.shard_cache_dir is not None:
            local_path(self.shard_cache_dir, "--shard-cache-dir")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(
                f"eval_fraction={self.eval_fraction}: must be in [0, 1) (0 disables the hash split)"
            )


@dataclass(kw_only=True, slots=True)
class DraftSpec:
    """The drafter's shape and block construction; the rest of the width is copied from the target."""

    num_draft_layers: int = 5
    target_layer_ids: tuple[int, ...] | None = None
    block_size: int = 16
    num_anchors: int = 512
    gamma: float | None = None
    # reach (slot_weights.py): on every quality-benchmark target within 4% of the best fixed gamma, which no
    # user can know in advance, and ahead of the paper's decay, fitted to drafters that accept 6-7 tokens
    # (BENCHMARKS.md); `--preset paper` keeps the paper's
    slot_weights: str = "reach"
    mask_token_id: int | None = None
    distill: float = 0.0  # share of the target's distribution in each label (loss.Distill); 0: hard labels
    copy_anchor_weight: float = 1.0  # odds of anchors prompt lookup copies (blocks.copy_preference)
    copy_slot_weight: float = 0.0  # least weight of slots prompt lookup copies (blocks.raise_copied_slots)

    def __post_init__(self) -> None:
        _positive("num_draft_layers", self.num_draft_layers)
        if not 0.0 <= self.distill <= 1.0:
            raise ValueError(f"distill={self.distill}: must be in [0, 1] (0: hard labels, 1: the target's)")
        _positive("num_anchors", self.num_anchors)
        if not (self.copy_anchor_weight >= 1.0 and math.isfinite(self.copy_anchor_weight)):
            raise ValueError(
                f"copy_anchor_weight={self.copy_anchor_weight}: must be a finite number >= 1 (1: uniform anchors)"
            )
        if not (self.copy_slot_weight >= 0.0 and math.isfinite(self.copy_slot_weight)):
            raise ValueError(
                f"copy_slot_weight={self.copy_slot_weight}: must be a finite number >= 0 (0: off)"
            )
        if self.block_size < 2:
            raise ValueError(
                f"block_size={self.block_size}: a block needs the anchor and at least one draft slot"
            )
        if self.target_layer_ids is not None:  # the target's depth is checked once the cache is open
            self.target_layer_ids = check_layer_ids(self.target_layer_ids)
        if self.gamma is not None and not self.gamma > 0:
            raise ValueError(f"gamma={self.gamma}: must be > 0")
        if self.slot_weights not in SLOT_WEIGHT_CHOICES:
            raise ValueError(
                f"slot_weights={self.slot_weights!r}: choose one of {', '.join(SLOT_WEIGHT_CHOICES)}"
            )

    @property
    def loss_gamma(self) -> float:
        """The decay the loader weighs slots with: the loss's own (`decay`), or `reach`'s floor."""
        if self.gamma is not None:
            return self.gamma
        return REACH_FLOOR_GAMMA if self.slot_weights == "reach" else default_gamma(self.block_size)


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """AdamW with warmup then cosine, clipping and accumulation (paper recipe by default)."""

    lr: float = 6e-4
    min_lr_frac: float = 0.0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    warmup_frac: float = 0.04
    grad_clip: float = 1.0
    grad_accum: int = 1
    epochs: int | None = None  # None: 6, raised toward 10 on a small dataset (`schedule.default_epochs`)
    max_steps: int | None = None

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr={self.lr}: must be a positive number, e.g. 6e-4")
        if not 0.0 <= self.min_lr_frac <= 1.0:
            raise ValueError(f"min_lr_frac={self.min_lr_frac}: must be in [0, 1]")
        if not 0.0 <= self.warmup_frac < 1.0:
            raise ValueError(f"warmup_frac={self.warmup_frac}: must be in [0, 1), e.g. 0.04")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay}: must be >= 0")
        for name, beta in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"{name}={beta}: must be in [0, 1)")
        if not (self.grad_clip >= 0 and math.isfinite(self.grad_clip)):
            raise ValueError(
                f"grad_clip={self.grad_clip}: must be a finite number >= 0 (0 disables clipping)"
            )
        _positive("grad_accum", self.grad_accum)
        if self.epochs is not None:
            _positive("epochs", self.epochs)
        if self.max_steps is not None:
            _positive("max_steps", self.max_steps)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything one `dflash-train` run needs; `meta.json` of every checkpoint holds it."""

    cache: str
    out: str
    resume: bool = False
    resume_from: str | None = None  # a checkpoint of `out` to continue from (implies resume)
    seed: int = 0
    device: str = "auto"
    attention: str = "auto"
    # FlexAttention over the context keys only, each block's own slots attended apart (`split_attention.py`):
    # same math; +7-9% a step on an H200 against FlexAttention's default forward tile, -3% against the
    # `mask.FORWARD_TILE` the trainer now uses (quality benchmark's 5-layer full-size step, BENCHMARKS.md)
    split_own_slots: bool = False
    compile: bool = True  # CUDA only: torch.compile the drafter's regions and loss epilogue (same math)
    eval_every: int = 500
    early_stop: float = DEFAULT_EARLY_STOP
    save_every: int = 1000
    log_every: int = 10
    keep_checkpoints: int = 3
    tensorboard: bool = True
    plots: bool = True
    progress: bool = True
    data: LoaderConfig = field(default_factory=LoaderConfig)
    drafter: DraftSpec = field(default_factory=DraftSpec)
    optim: OptimConfig = field(default_factory=OptimConfig)

    def __post_init__(self) -> None:
        if not self.cache:
            raise ValueError("cache is empty: pass --cache CACHE_DIR (a directory written by dflash-extract)")
        if not self.out:
            raise ValueError("out is empty: pass --out RUN_DIR (where checkpoints and metrics go)")
        if self.resume_from:
            self.resume = True
        local_path(self.out, "--out")  # a run directory is local (each node writes its own checkpoints)
        if is_url(self.cache):
            check_url(self.cache, "--cache")
        if self.device not in DEVICE_CHOICES:
            raise ValueError(f"device={self.device!r}: choose one of {', '.join(DEVICE_CHOICES)}")
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention={self.attention!r}: choose one of {', '.join(ATTENTION_CHOICES)}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed={self.seed!r}: --seed must be an integer in 0..{MAX_SEED}")
        for name in ("eval_every", "save_every", "log_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0 (0 disables it)")
        _positive("keep_checkpoints", self.keep_checkpoints)
        if not 0.0 <= self.early_stop < 1.0:
            raise ValueError(f"early_stop={self.early_stop}: must be in [0, 1), e.g. 0.02 (0: never)")

    def open_cache(self, **kwargs: Any) -> Any:
        """`Cache.open` of `cache` with the run's local copies of a remote cache (`shard_cache_*`)."""
        from dflash.shards import Cache

        local = None
        if self.data.shard_cache_dir is not None and is_url(self.cache):
            local = default_local_dir(self.cache, self.data.shard_cache_dir)
        return Cache.open(
            self.cache, local_dir=local, shard_cache_bytes=int(self.data.shard_cache_gb * 1e9), **kwargs
        )

    def to_flat(self) -> dict[str, Any]:
        """One flat JSON-able dict (section fields inlined), the inverse of `config_from_flat`."""
        flat: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                for g in dataclasses.fields(value):
                    item = getattr(value, g.name)
                    flat[g.name] = list(item) if isinstance(item, tuple) else item
            else:
                flat[f.name] = value
        return flat


SECTIONS: dict[str, type] = {"data": LoaderConfig, "drafter": DraftSpec, "optim": OptimConfig}


def flat_keys() -> dict[str, str | None]:
    """Every accepted flat key -> its section name (None for top-level fields)."""
    keys: dict[str, str | None] = {}
    for f in dataclasses.fields(TrainConfig):
        if f.name in SECTIONS:
            for g in dataclasses.fields(SECTIONS[f.name]):
                keys[g.name] = f.name
        else:
            keys[f.name] = None
    return keys


def config_from_flat(values: Mapping[str, Any], base: TrainConfig | None = None) -> TrainConfig:
    """Build a config from flat keys (dashes or underscores), on top of `base` or the defaults."""
    known = flat_keys()
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    if base is not None:
        for key, value in base.to_flat().items():
            (sections[known[key]] if known[key] else top)[key] = value
    for raw_key, value in values.items():
        key = raw_key.replace("-", "_")
        if key not in known:
            close = [k for k in known if k.startswith(key[:4])]
            hint = f" (did you mean {', '.join(sorted(close))}?)" if close else ""
            raise ValueError(f"unknown config key {raw_key!r}{hint}")
        (sections[known[key]] if known[key] else top)[key] = value
    if "target_layer_ids" in sections["drafter"]:
        sections["drafter"]["target_layer_ids"] = parse_layer_ids(sections["drafter"]["target_layer_ids"])
    for name in ("cache", "out"):
        if name not in top:
            raise ValueError(f"{name} is required: pass --{name} or set it in the config file")
    parts = {name: cls(**sections[name]) for name, cls in SECTIONS.items()}
    return TrainConfig(**top, **parts)


def parse_layer_ids(value: Any) -> tuple[int, ...] | None:
    """`"1,9,17"`, `[1, 9, 17]` or None -> a tuple of ints."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            return tuple(int(part) for part in value.replace(" ", "").split(",") if part)
        except ValueError:
            raise ValueError(
                f"target_layer_ids={value!r}: give comma-separated integers, e.g. 1,9,17,25,33"
            ) from None
    return tuple(int(v) for v in value)


# --- presets -------------------------------------------------------------------------------------


def default_recipe(cache: str, out: str, **overrides: Any) -> TrainConfig:
    """dflash-train's default: the paper's recipe with loss weights that follow the drafter (`reach`)."""
    return config_from_flat({"cache": cache, "out": out, **overrides})


def paper_recipe(cache: str, out: str, **overrides: Any) -> TrainConfig:
    """The DFlash paper recipe: 5 layers, B=16, 512 anchors, AdamW 6e-4, 4% warmup + cosine, 6 epochs, the
    loss decay exp(-(k-1)/gamma) with gamma 7 for B = 16."""
    values = {"slot_weights": "decay", "epochs": 6, "early_stop": 0.0}  # the paper trains its whole schedule
    return config_from_flat({"cache": cache, "out": out, **values, **overrides})


def tiny_debug(cache: str, out: str, **overrides: Any) -> TrainConfig:
    """Seconds on a CPU: tiny batches, frequent logging, evaluation and checkpoints."""
    values: dict[str, Any] = {
        "cache": cache,
        "out": out,
        "num_draft_layers": 1,
        "block_size": 4,
        "num_anchors": 8,
        "token_budget": 256,
        "max_length": 128,
        "loader_threads": 2,
        "prefetch_batches": 4,
        "shuffle_window": 16,
        "eval_samples": 8,
        "eval_fraction": 0.2,
        "epochs": 2,
        "lr": 1e-3,
        "eval_every": 10,
        "early_stop": 0.0,  # a tiny drafter's walk on 8 rows moves by more than any threshold
        "save_every": 10,
        "log_every": 1,
        "device": "cpu",
        "progress": False,
    }
    values.update(overrides)
    return config_from_flat(values)


def _positive(name: str, value: int) -> None:
    if not value > 0:
        raise ValueError(f"{name}={value}: must be > 0")
