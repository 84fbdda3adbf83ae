"""The front half of every extraction, dry run included: target config -> layers -> dataset -> plan.

Reads only the target's config.json (no weights, no torch import): seconds for a 900k-row dataset.
The dry run reports what `prepare` decided; a real run then writes exactly that plan, and its manifest
(`cache_manifest`) records it so a resume can refuse a different one.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass

import numpy as np
from dflash.shards.manifest import Manifest, target_info
from dflash.shards.target_config import TargetConfig, read_target_config

from .config import ExtractConfig
from .dataset import TokenDataset, open_dataset
from .identity import weights_fingerprint
from .plan import BatchPlan, WorkUnit, bytes_per_token, plan_batches, plan_units
from .validate import DatasetReport, validate


@dataclass(frozen=True, slots=True)
class PreparedRun:
    """Everything decided before the first forward: layers, kept rows, batches, work units."""

    target: TargetConfig
    layers: list[int]
    dataset: TokenDataset
    report: DatasetReport
    batches: BatchPlan
    units: list[WorkUnit]
    seconds: dict[str, float]


def planned_dtype(config: ExtractConfig) -> str:
    """The dtype the run will compute in, as the pipeline resolves it ('auto': float32 on a CPU, else
    bfloat16: the dry run does not look for a GPU)."""
    if config.dtype != "auto":
        return config.dtype
    return "float32" if config.device == "cpu" else "bfloat16"


def prepare(config: ExtractConfig, compute_dtype: str | None = None) -> PreparedRun:
    """Read the target's config, resolve the layers, open + validate the dataset, plan batches and units.

    Units are sized by the bytes a token stores in `compute_dtype` (the run's resolved dtype; None: as
    `planned_dtype` expects it): float32 states store ~2.4x bf16's losslessly."""
    target = read_target_config(config.target)
    layers = config.resolved_layers(target.num_hidden_layers)
    t0 = time.perf_counter()
    ds = open_dataset(config.dataset, config.columns)
    t1 = time.perf_counter()
    report = validate(ds, vocab_size=target.vocab_size, max_len=config.max_len, overlong=config.overlong)
    if not len(report.rows) and not config.allow_empty:
        raise ValueError(
            f"{config.dataset}: no row to extract ({ds.num_rows} rows, {len(report.skipped_rows)} skipped: "
            f"{report.counts}); pass --allow-empty to write an empty cache anyway"
        )
    _refuse_past_positions(config, target, report)
    t2 = time.perf_counter()
    batches = plan_batches(
        report.rows, report.lengths, token_budget=config.token_budget, pad_multiple=config.pad_multiple
    )
    per_token = bytes_per_token(
        config.codec, len(layers), target.hidden_size, compute_dtype or planned_dtype(config)
    )
    units = plan_units(batches, bytes_per_token=per_token, unit_bytes=config.unit_bytes)
    t3 = time.perf_counter()
    seconds = {"open": t1 - t0, "validate": t2 - t1, "plan": t3 - t2}
    return PreparedRun(target, layers, ds, report, batches, units, seconds)


def _refuse_past_positions(config: ExtractConfig, target: TargetConfig, report: DatasetReport) -> None:
    """Rows (as kept: cut to --max-len) longer than the target's `max_position_embeddings` would be run at
    positions it was never trained on: refused, in the dry run too, rather than cached."""
    limit = target.decoder.get("max_position_embeddings")
    longest = int(report.lengths.max()) if len(report.lengths) else 0
    if type(limit) is int and limit > 0 and longest > limit:
        over = int((report.lengths > limit).sum())
        raise ValueError(
            f"{config.dataset}: {over:,} rows are longer than the target's max_position_embeddings {limit:,} "
            f"(the longest {longest:,} tokens, kept up to --max-len {config.max_len:,}): the target never saw "
            f"those positions; pass --max-len {limit} or less (rows are cut to it)"
        )


def plan_digest(batches: BatchPlan, units: list[WorkUnit]) -> str:
    """sha256 of the plan: every batch's rows and lengths and the unit boundaries."""
    h = hashlib.sha256()
    for b in batches:
        h.update(np.ascontiguousarray(b.rows, dtype="<i8").tobytes())
        h.update(np.ascontiguousarray(b.lengths, dtype="<i8").tobytes())
        h.update(b"|")
    h.update(json.dumps([[u.batch_start, u.batch_stop] for u in units]).encode())
    return h.hexdigest()


def cache_manifest(config: ExtractConfig, run: PreparedRun, *, compute_dtype: str) -> Manifest:
    """The manifest a cache of this run starts with (complete=false, no shards yet)."""
    from dflash.shards.codecs import get_codec  # torch: not for the dry run

    codec = get_codec(config.codec)
    return Manifest(
        target={
            **target_info(run.target.raw, str(config.target), dtype=compute_dtype),
            "weights_sha256": weights_fingerprint(config.target),  # a resume compares targets by content
        },
        layers=run.layers,
        dtype=codec.stored_dtype(compute_dtype),
        hidden_size=run.target.hidden_size,
        codec=codec.to_dict(),
        dataset=run.dataset.fingerprint(),
        options={
            "max_len": config.max_len,
            "overlong": config.overlong,
            "token_budget": config.token_budget,
            "pad_multiple": config.pad_multiple,
            "unit_bytes": config.unit_bytes,
            "compute_dtype": compute_dtype,
            **({"allow_empty": True} if config.allow_empty else {}),
        },
        plan={
            "units": len(run.units),
            "batches": len(run.batches),
            "rows": len(run.report.rows),
            "tokens": run.report.tokens,
            "sha256": plan_digest(run.batches, run.units),
        },
    )
