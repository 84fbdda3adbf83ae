"""`dflash-extract --dry-run`: open, validate and plan, then report sizes against free disk space.

Reads only the target's config.json (no weights, no torch import): seconds for a 900k-row dataset.
What it reports is what `prepare.prepare` decided, the same front half a real extraction runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dflash.shards.codec_costs import codec_table, format_codec_table
from dflash.shards.outdir import check_out_dir
from dflash.shards.sizes import size_text

from .config import STAGED_UNITS, ExtractConfig
from .plan import estimate_cache_bytes, plan_stats
from .prepare import PreparedRun, planned_dtype, prepare


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
    estimate = estimate_cache_bytes(
        report.tokens, len(report.rows), len(run.layers), run.target.hidden_size, planned_dtype(config)
    )
    last = run.target.num_hidden_layers - 1
    cached = last in run.layers
    extra_bytes = 0
    if not cached:  # what adding the last layer to --layers would cost with this codec
        with_last = estimate_cache_bytes(
            report.tokens,
            len(report.rows),
            len(run.layers) + 1,
            run.target.hidden_size,
            planned_dtype(config),
        )
        extra_bytes = with_last[config.codec] - estimate[config.codec]
    free, probe = free_space(config.out)
    local_need = estimate[config.codec]
    if config.publish_to:  # published to object storage, the staging directory holds a few shards at a time
        local_need = min(local_need, STAGED_UNITS * config.unit_bytes)
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
        "target": {"path": str(config.target), **run.target.shape()},
        "dataset": {
            "path": str(config.dataset),
            "form": run.dataset.form,
            "chunks": run.dataset.num_chunks,
            "files": len(run.dataset.files),
        },
        "codec": config.codec,
        # `dflash-train --distill` reads the target's last layer through its final norm and lm_head
        "distill": {
            "last_layer": last,
            "cached": cached,
            "extra_bytes": extra_bytes,
        },
        "dtype": planned_dtype(config),
        "bytes_estimate": estimate,
        "codecs": codec_table(estimate, planned_dtype(config)),
        "free_bytes": free,
        "free_path": str(probe),
        "publish_to": config.publish_to,
        "fits": local_need <= free,
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
    verdict = "fits" if s["fits"] else f"does NOT fit ({size_text(est[chosen])} needed with {chosen})"
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
        ("work units", f"{s['units']:,} shards of ~{size_text(s['unit_bytes'])}"),
        ("distillation", _distill_text(s["distill"], chosen)),
        ("free space", f"{size_text(s['free_bytes'])} on {s['free_path']}: {verdict}"),
        (
            "time",
            f"open {s['open_seconds']:.2f} s, validate {s['validate_seconds']:.2f} s, plan {s['plan_seconds']:.2f} s",
        ),
    ]
    width = max(len(k) for k, _ in lines)
    table = format_codec_table(s["codecs"], chosen, size_text)
    return "\n".join([*(f"{k:<{width}}  {v}" for k, v in lines), table])


def _distill_text(distill: dict, codec: str) -> str:
    last = distill["last_layer"]
    if distill["cached"]:
        return f"`dflash-train --distill` can use this cache: its last layer ({last}) is in it"
    return (
        f"`dflash-train --distill` needs the last layer ({last}): add it to --layers "
        f"(+{size_text(distill['extra_bytes'])} with {codec})"
    )


def run_dry_run(config: ExtractConfig) -> dict:
    """Prepare, print the table (or one JSON object with `config.json`), return the summary."""
    if config.out is not None:
        check_out_dir(config.out, "cache")  # the run would refuse this --out: say so now
    summary = dry_run_summary(config, prepare(config))
    print(json.dumps(summary) if config.json else format_summary(summary), flush=True)
    return summary
