"""`dflash-extract --dry-run`: open, validate and plan, then report sizes against free disk space.

Reads only the target's config.json (no weights, no torch import): seconds for a 900k-row dataset.
`prepare` is the shared front half of a real extraction (the pipeline calls it too).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from dflash.shards.manifest import decoder_config
from dflash.shards.outdir import check_out_dir
from dflash.shards.safe_io import read_json

from .config import ExtractConfig
from .dataset import TokenDataset, open_dataset
from .plan import (
    BatchPlan,
    WorkUnit,
    bytes_per_token,
    estimate_cache_bytes,
    plan_batches,
    plan_stats,
    plan_units,
)
from .validate import DatasetReport, validate


@dataclass(frozen=True, slots=True)
class TargetShape:
    """The few target facts planning needs, from config.json (text params of VLM wrappers included)."""

    model_type: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int

    def to_dict(self) -> dict:
        return {
            "model_type": self.model_type,
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
        }


def read_target_shape(target: Path) -> TargetShape:
    """Read `target/config.json`; a VLM wrapper (e.g. qwen3_5) keeps its text params under `text_config`."""
    path = Path(target) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"target: no config.json in {target}; pass the HF model directory as --target"
        )
    config = read_json(path, max_bytes=16 << 20, what="target:")  # depth-limited; FIFOs refused
    if not isinstance(config, dict):
        raise ValueError(f"target: {path} holds a JSON {type(config).__name__}, not a config object")
    text = decoder_config(config)
    missing = [
        k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if not isinstance(text.get(k), int)
    ]
    if missing:
        raise ValueError(f"target: {path} lacks integer {', '.join(missing)}")
    return TargetShape(
        model_type=str(config.get("model_type", "unknown")),
        num_hidden_layers=text["num_hidden_layers"],
        hidden_size=text["hidden_size"],
        vocab_size=text["vocab_size"],
    )


@dataclass(frozen=True, slots=True)
class PreparedRun:
    """Everything decided before the first forward: layers, kept rows, batches, work units."""

    target: TargetShape
    layers: list[int]
    dataset: TokenDataset
    report: DatasetReport
    batches: BatchPlan
    units: list[WorkUnit]
    seconds: dict[str, float]


def prepare(config: ExtractConfig, target: TargetShape) -> PreparedRun:
    """Resolve layers, open + validate the dataset, plan batches and work units (deterministic)."""
    layers = config.resolved_layers(target.num_hidden_layers)
    t0 = time.perf_counter()
    ds = open_dataset(config.dataset, config.columns)
    t1 = time.perf_counter()
    report = validate(ds, vocab_size=target.vocab_size, max_len=config.max_len, overlong=config.overlong)
    t2 = time.perf_counter()
    batches = plan_batches(
        report.rows, report.lengths, token_budget=config.token_budget, pad_multiple=config.pad_multiple
    )
    per_token = bytes_per_token(config.codec, len(layers), target.hidden_size)
    units = plan_units(batches, bytes_per_token=per_token, unit_bytes=config.unit_bytes)
    t3 = time.perf_counter()
    seconds = {"open": t1 - t0, "validate": t2 - t1, "plan": t3 - t2}
    return PreparedRun(target, layers, ds, report, batches, units, seconds)


def free_space(out: Path | None) -> tuple[int, Path]:
    """Free bytes on the filesystem that would hold `out` (its nearest existing ancestor; cwd when None)."""
    probe = Path(out).resolve() if out is not None else Path.cwd()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free, probe


def dry_run_summary(config: ExtractConfig, run: PreparedRun) -> dict:
    """The dry-run result as one JSON-able dict."""
    report = run.report
    stats = plan_stats(run.batches)
    estimate = estimate_cache_bytes(report.tokens, len(report.rows), len(run.layers), run.target.hidden_size)
    free, probe = free_space(config.out)
    summary = report.summary()
    return {
        **summary,
        "batches": stats["batches"],
        "padded_tokens": stats["padded_tokens"],
        "padding_overhead": stats["padding_overhead"],
        "max_batch_tokens": stats["max_batch_tokens"],
        "max_batch_rows": stats["max_batch_rows"],
        "units": len(run.units),
        "unit_bytes": config.unit_bytes,
        "token_budget": config.token_budget,
        "pad_multiple": config.pad_multiple,
        "layers": run.layers,
        "target": {"path": str(config.target), **run.target.to_dict()},
        "dataset": {
            "path": str(config.dataset),
            "form": run.dataset.form,
            "chunks": run.dataset.num_chunks,
            "files": len(run.dataset.files),
        },
        "codec": config.codec,
        "bytes_estimate": estimate,
        "free_bytes": free,
        "free_path": str(probe),
        "fits": estimate[config.codec] <= free,
        "open_seconds": round(run.seconds["open"], 4),
        "validate_seconds": round(run.seconds["validate"], 4),
        "plan_seconds": round(run.seconds["plan"], 4),
    }


def format_summary(s: dict) -> str:
    """A short human-readable table of a dry-run summary."""
    skipped = ", ".join(f"{k} {v:,}" for k, v in s["skipped"].items())
    t = s["target"]
    est = s["bytes_estimate"]
    chosen = s["codec"]
    verdict = "fits" if s["fits"] else f"does NOT fit ({_size(est[chosen])} needed with {chosen})"
    lines = [
        (
            "target",
            f"{t['path']} ({t['model_type']}, {t['num_hidden_layers']} layers, hidden {t['hidden_size']}, "
            f"vocab {t['vocab_size']}); layers {s['layers']}",
        ),
        (
            "dataset",
            f"{s['dataset']['path']} ({s['dataset']['form']}, {s['dataset']['files']} files, "
            f"{s['dataset']['chunks']} chunks, {s['rows_total']:,} rows)",
        ),
        ("rows kept", f"{s['rows']:,} ({s['rows_truncated']:,} truncated to {s['max_len']})"),
        ("rows skipped", f"{s['rows_skipped']:,} ({skipped})"),
        ("tokens", f"{s['tokens']:,} ({s['supervised_tokens']:,} supervised)"),
        (
            "batches",
            f"{s['batches']:,} under {s['token_budget']:,} padded tokens (largest {s['max_batch_tokens']:,} "
            f"tokens, {s['max_batch_rows']} rows)",
        ),
        ("padding", f"{s['padded_tokens']:,} padded tokens, overhead {100 * s['padding_overhead']:.2f}%"),
        ("work units", f"{s['units']:,} shards of ~{_size(s['unit_bytes'])}"),
        (
            "cache size",
            "  ".join(f"{name} {_size(v)}{' *' if name == chosen else ''}" for name, v in est.items()),
        ),
        ("free space", f"{_size(s['free_bytes'])} on {s['free_path']}: {verdict}"),
        (
            "time",
            f"open {s['open_seconds']:.2f} s, validate {s['validate_seconds']:.2f} s, plan {s['plan_seconds']:.2f} s",
        ),
    ]
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in lines)


def run_dry_run(config: ExtractConfig) -> dict:
    """Prepare, print the table (or one JSON object with `config.json`), return the summary."""
    if config.out is not None:
        check_out_dir(config.out, "cache")  # the run would refuse this --out: say so now
    target = read_target_shape(config.target)
    summary = dry_run_summary(config, prepare(config, target))
    print(json.dumps(summary) if config.json else format_summary(summary), flush=True)
    return summary


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
