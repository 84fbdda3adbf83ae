"""What the training loader and evaluation read from a cache and how they turn it into batches.

`DataSpec` is the one set of settings both are configured from (built once per run by `for_run`), and
the reading helpers below apply the run's `--on-corrupt` policy the same way for both: `fail` raises
one line naming the shard or sample, `skip` hands the error back for the caller to count. A shard
whose identity disagrees with the manifest (`Cache.shard`) is an unreadable shard like any other. Two
refusals are not one shard's damage: a row stored twice (`DuplicateRows`) stops the run under either
policy, and a header that contradicts the manifest (`LayoutMismatch`: mixed caches) is not offered the
skip, which would drop every shard when the manifest is the file that changed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from dflash.shards import Cache, Sample
from dflash.shards.errors import DuplicateRows, LayoutMismatch, ShardError
from dflash.shards.safe_io import load_json, read_regular

from .blocks import PackedBatch, make_packed_batch
from .config import TrainConfig
from .data_plan import SampleRef, ShardEntries

if TYPE_CHECKING:
    from .drafter_config import DrafterConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class DataSpec:
    """Blocks (layers, size, mask token, anchors, loss decay), packing, held-out split, corrupt policy, and
    the loader's threads and buffers. Evaluation reads the same fields and ignores the loader-only ones."""

    layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    num_anchors: int
    gamma: float
    copy_anchor_weight: float = 1.0  # anchors' odds where prompt lookup copies (blocks.copy_preference)
    copy_slot_weight: float = 0.0  # least weight of slots prompt lookup copies (blocks.raise_copied_slots)
    token_budget: int
    max_length: int
    on_corrupt: str = "fail"
    heldout_fraction: float = 0.0
    heldout_rows: frozenset[int] = frozenset()
    eval_samples: int = 128
    seed: int = 0
    attention: str = "auto"
    split_own_slots: bool = False  # FlexAttention's tiles over the context keys only (`split_attention.py`)
    # loader only
    epochs: int = 1
    order: str = "spans"  # how an epoch orders the cache (`data_plan.ORDERS`)
    shuffle_window: int = 1024
    loader_threads: int = 4
    loader_workers: int | None = 0  # None: `loader_procs.streaming_loader` picks by device
    prefetch_batches: int = 8
    pad_blocks_to_multiple: int = 1
    dequantize_on_device: bool | None = None  # fp8/q stay undecoded until on the device (default: on CUDA)

    def __post_init__(self) -> None:
        if self.on_corrupt not in ("skip", "fail"):
            raise ValueError(f"on_corrupt={self.on_corrupt!r}: choose skip or fail")
        if isinstance(self.epochs, bool) or not isinstance(self.epochs, int) or self.epochs < 1:
            raise ValueError(
                f"epochs={self.epochs!r}: must be a whole number >= 1 (a run pins a left-out --epochs before "
                "its data spec: run_parts.settle_epochs)"
            )
        object.__setattr__(self, "layer_ids", tuple(self.layer_ids))

    @classmethod
    def for_run(
        cls,
        cfg: TrainConfig,
        drafter_cfg: DrafterConfig,
        heldout_rows: frozenset[int] = frozenset(),
        **overrides: Any,
    ) -> DataSpec:
        """The spec a run with `cfg` trains and evaluates with; `overrides` replace single fields
        (benchmarks use them, e.g. `loader_threads`). Distillation's teacher, the target's last layer, is
        read after the drafter's features when it is not one of them (the drafter sees only its own)."""
        layer_ids = drafter_cfg.target_layer_ids
        teacher = drafter_cfg.num_target_layers - 1
        if cfg.drafter.distill > 0 and teacher not in layer_ids:
            layer_ids = (*layer_ids, teacher)
        spec = cls(
            layer_ids=layer_ids,
            block_size=drafter_cfg.block_size,
            mask_token_id=drafter_cfg.mask_token_id,
            num_anchors=cfg.drafter.num_anchors,
            gamma=cfg.drafter.loss_gamma,
            copy_anchor_weight=cfg.drafter.copy_anchor_weight,
            copy_slot_weight=cfg.drafter.copy_slot_weight,
            token_budget=cfg.data.token_budget,
            max_length=cfg.data.max_length,
            on_corrupt=cfg.data.on_corrupt,
            heldout_fraction=cfg.data.eval_fraction,
            heldout_rows=heldout_rows,
            eval_samples=cfg.data.eval_samples,
            seed=cfg.seed,
            attention=cfg.attention,
            split_own_slots=cfg.split_own_slots,
            epochs=cfg.optim.epochs,
            order=cfg.data.data_order,
            shuffle_window=cfg.data.shuffle_window,
            loader_threads=cfg.data.loader_threads,
            loader_workers=cfg.data.loader_workers,
            prefetch_batches=cfg.data.prefetch_batches,
        )
        return dataclasses.replace(spec, **overrides)

    def to_json(self) -> dict[str, Any]:
        """The spec as JSON values (a loader process is configured with it)."""
        d = dataclasses.asdict(self)
        d["layer_ids"], d["heldout_rows"] = list(self.layer_ids), sorted(self.heldout_rows)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DataSpec:
        return cls(**{**d, "layer_ids": tuple(d["layer_ids"]), "heldout_rows": frozenset(d["heldout_rows"])})

    def pack(
        self,
        samples: Sequence[Any],
        *,
        generator: torch.Generator | None = None,
        anchors: Sequence[torch.Tensor] | None = None,
        num_anchors: int | None = None,
    ) -> PackedBatch:
        """Blocks of `samples` with this spec's layers, block size, mask token and loss decay."""
        return make_packed_batch(
            samples,
            block_size=self.block_size,
            mask_token_id=self.mask_token_id,
            num_anchors=self.num_anchors if num_anchors is None else num_anchors,
            gamma=self.gamma,
            generator=generator,
            anchors=anchors,
            layer_ids=self.layer_ids,
            pad_blocks_to_multiple=self.pad_blocks_to_multiple,
            copy_anchor_weight=self.copy_anchor_weight,
            copy_slot_weight=self.copy_slot_weight,
        )


_NO_ENTRIES = ShardEntries(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))


def shard_entries(cache: Cache, name: str, on_corrupt: str, bad_shards: dict[str, str]) -> ShardEntries:
    """A shard's index for planning. An unreadable shard (or one that is not the manifest's) raises under
    `fail`; under `skip` it is recorded in `bad_shards` (logged once) and contributes no samples."""
    try:
        reader = cache.shard(name)
    except DuplicateRows:
        raise  # not damage to one shard: skipping the one that repeats a row would drop its other rows too
    except (ShardError, OSError) as exc:
        if on_corrupt != "skip":
            raise _with_hint(exc, "pass --on-corrupt skip to go on without this shard") from None
        if name not in bad_shards:
            bad_shards[name] = str(exc)
            log.warning("skipping shard %s: %s", name, exc)
        return _NO_ENTRIES
    entries = reader.entries
    return ShardEntries(
        rows=reader.rows,
        lengths=np.fromiter((e.length for e in entries), np.int64, len(entries)),
        supervised=np.fromiter((e.supervised for e in entries), np.int64, len(entries)),
    )


def _with_hint(exc: BaseException, hint: str) -> BaseException:
    """`exc` naming the --on-corrupt way around it, unless it is a layout mismatch: files of two caches mixed,
    where skipping would drop every shard when the manifest is the file that changed."""
    return exc if isinstance(exc, LayoutMismatch) else ShardError(f"{exc} ({hint})")


def read_sample(
    cache: Cache, ref: SampleRef, spec: DataSpec, *, dequantize: bool = True
) -> Sample | ShardError:
    """The sample `ref` with the spec's layers, cut to `max_length` while decoding (the tokens past it are
    never decompressed: --max-length bounds memory whatever length the index claims); under `skip` a
    corrupt sample comes back as its error (the caller counts it), under `fail` it raises."""
    try:
        return cache.shard(ref.shard).read(
            ref.index, spec.layer_ids, dequantize=dequantize, max_tokens=spec.max_length
        )
    except DuplicateRows:
        raise
    except (ShardError, OSError) as exc:
        if spec.on_corrupt != "skip":
            raise _with_hint(exc, "pass --on-corrupt skip to drop corrupt samples") from None
        return exc if isinstance(exc, ShardError) else ShardError(f"row {ref.row}: {exc}")


MAX_EVAL_ROWS_BYTES = 1 << 30  # a list of row ids: far more than any dataset needs, still bounded
MAX_ROW_ID = 2**63 - 1  # row ids are int64 in every index


def read_eval_rows(path: str | Path | None) -> frozenset[int]:
    """Row ids held out explicitly (`--eval-rows`): a JSON list or one integer per line."""
    if not path:
        return frozenset()
    try:
        text = read_regular(path, MAX_EVAL_ROWS_BYTES, "--eval-rows").decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise ValueError(f"--eval-rows {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        rows = (
            load_json(text, f"--eval-rows {path}") if text.startswith("[") else [int(x) for x in text.split()]
        )
        if not isinstance(rows, list):
            raise TypeError
        bad = [r for r in rows if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r <= MAX_ROW_ID]
    except (ValueError, TypeError, ShardError):
        raise ValueError(
            f"--eval-rows {path}: expected a JSON list of row ids or one integer per line"
        ) from None
    if bad:
        shown = repr(bad[0])
        raise ValueError(
            f"--eval-rows {path}: row id {shown if len(shown) <= 40 else shown[:37] + '...'} is not an "
            f"integer in 0..{MAX_ROW_ID}"
        )
    return frozenset(rows)
