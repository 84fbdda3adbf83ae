"""`dflash-tokenize`: chat data + a HF tokenizer with a chat template -> a tokenized `save_to_disk` dataset.

Output columns (what `dflash-extract` reads): `input_ids` (list<int32>), `loss_mask` (list<uint8>,
1 on assistant tokens) and `seq_len` (int32). The mask follows the template's own `{% generation %}`
markers when it has them (so the template decides whether e.g. `<|im_end|>` is supervised), else
the character spans of the assistant contents in the rendered text, mapped to tokens through the
fast tokenizer's offsets. Malformed conversations are skipped and counted by reason; the summary
goes to stdout (one JSON object with `--json`) and to `OUT/tokenize_summary.json`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dflash.shards.atomic import commit_dir, temp_path
from dflash.shards.cli import DefaultsHelp, run_main
from dflash.shards.errors import ShardError
from dflash.shards.safe_io import read_json
from dflash.shards.target_config import CONFIG_NAME, decoder_config

from .chat import FORMATS, SKIP_REASONS, has_generation_markers
from .chat_input import open_chat_source
from .chat_tokenize import ConversationEncoder

log = logging.getLogger(__name__)

SUMMARY_NAME = "tokenize_summary.json"
DEFAULT_MAX_LEN = 32768  # --max-len when neither the tokenizer nor a config.json beside it gives a limit
UNSET_TOKENIZER_LIMIT = 10**8  # transformers' model_max_length when the tokenizer declares none is ~1e30


@dataclass(kw_only=True, slots=True)
class TokenizeConfig:
    """Every setting of `dflash-tokenize`, checked up front."""

    data: str
    tokenizer: str
    out: str
    format: str = "auto"
    last_turn_only: bool = False
    max_len: int | None = None
    num_proc: int = 1
    batch_size: int = 256
    json: bool = False
    overwrite: bool = False

    def __post_init__(self) -> None:
        if self.format not in ("auto", *FORMATS):
            raise ValueError(f"--format must be auto, messages or conversations, got {self.format!r}")
        if self.max_len is not None and self.max_len < 2:
            raise ValueError(
                f"--max-len must be >= 2 tokens (or left out for the tokenizer's limit), got {self.max_len}"
            )
        if self.num_proc < 1:
            raise ValueError(f"--num-proc must be >= 1, got {self.num_proc}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        out, data = Path(self.out).resolve(), Path(self.data).resolve()
        if out == data or data in out.parents:
            raise ValueError(f"--out {self.out} must not be --data or inside it; choose another directory")


def _output_features():
    import datasets

    return datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("uint8")),
            "seq_len": datasets.Value("int32"),
            "supervised": datasets.Value("int32"),
            "truncated": datasets.Value("bool"),
            "skip_reason": datasets.Value("string"),
        }
    )


def default_max_len(tokenizer, tok_dir: Path) -> tuple[int, str]:
    """(--max-len when none is given, where it comes from): the smaller of the model's
    `max_position_embeddings` (a config.json beside the tokenizer) and the tokenizer's `model_max_length`,
    else `DEFAULT_MAX_LEN`. Longer rows could not be extracted anyway: the target never saw those positions."""
    limits: dict[str, int] = {}
    tokenizer_limit = getattr(tokenizer, "model_max_length", None)
    if type(tokenizer_limit) is int and 2 <= tokenizer_limit < UNSET_TOKENIZER_LIMIT:
        limits["the tokenizer's model_max_length"] = tokenizer_limit
    config = tok_dir / CONFIG_NAME
    if config.is_file():
        try:
            positions = decoder_config(read_json(config, max_bytes=1 << 20)).get("max_position_embeddings")
        except (ShardError, OSError, AttributeError):
            positions = None
        if type(positions) is int and positions >= 2:
            limits[f"max_position_embeddings of {config}"] = positions
    if not limits:
        return DEFAULT_MAX_LEN, "the default"
    source = min(limits, key=limits.__getitem__)
    return limits[source], source


def _prepare_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; choose a directory")
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ValueError(
                f"--out {out} is not empty; remove it, choose another directory, or pass --overwrite"
            )
        if not ((out / "state.json").exists() or (out / SUMMARY_NAME).exists()):
            raise ValueError(f"--out {out} does not look like a tokenized dataset; refusing to overwrite it")


def _summarize(
    mapped, cfg: TokenizeConfig, source, mask_source: str, max_len_from: str, seconds: float
) -> dict:
    import numpy as np
    import pyarrow.compute as pc

    table = mapped.data.table if hasattr(mapped.data, "table") else mapped.data
    reasons = table.column("skip_reason")
    kept = pc.equal(reasons, "")
    skipped = {r: 0 for r in SKIP_REASONS}
    for item in pc.value_counts(pc.filter(reasons, pc.invert(kept))).to_pylist():
        skipped[item["values"]] = int(item["counts"])
    seq_len = pc.filter(table.column("seq_len"), kept).to_numpy().astype(np.int64)
    supervised = pc.filter(table.column("supervised"), kept).to_numpy().astype(np.int64)
    truncated = int(pc.sum(pc.filter(table.column("truncated"), kept)).as_py() or 0)
    return {
        "data": str(cfg.data),
        "input_form": source.form,
        "format": source.key,
        "tokenizer": str(cfg.tokenizer),
        "out": str(cfg.out),
        "mask_source": mask_source,
        "last_turn_only": cfg.last_turn_only,
        "max_len": cfg.max_len,
        "max_len_from": max_len_from,
        "rows_in": int(table.num_rows),
        "rows_out": len(seq_len),
        "skipped": {r: n for r, n in skipped.items() if n},
        "rows_skipped": int(sum(skipped.values())),
        "truncated_rows": truncated,
        "tokens": int(seq_len.sum()),
        "supervised_tokens": int(supervised.sum()),
        "max_seq_len": int(seq_len.max()) if len(seq_len) else 0,
        "mean_seq_len": round(float(seq_len.mean()), 1) if len(seq_len) else 0.0,
        "seconds": round(seconds, 2),
    }


def tokenize_chats(cfg: TokenizeConfig) -> dict:
    """Run `dflash-tokenize`; returns the summary (also written to `OUT/tokenize_summary.json`)."""
    from transformers import AutoTokenizer

    start = time.perf_counter()
    out = Path(cfg.out)
    _prepare_out(out, cfg.overwrite)
    tok_dir = Path(cfg.tokenizer)
    if not tok_dir.is_dir():
        raise FileNotFoundError(f"--tokenizer {tok_dir}: not a directory (expected a HF tokenizer directory)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    except (OSError, ValueError, KeyError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"--tokenizer {tok_dir}: cannot load a tokenizer from it ({first_line})") from None
    if not tokenizer.chat_template:
        raise ValueError(
            f"--tokenizer {tok_dir} has no chat template; use the chat (instruct) model's tokenizer"
        )
    if cfg.max_len is None:  # rows past the model's positions could not be extracted: never keep them
        cfg.max_len, max_len_from = default_max_len(tokenizer, tok_dir)
    else:
        max_len_from = "--max-len"
    use_markers = has_generation_markers(tokenizer.chat_template)
    if not use_markers and not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"--tokenizer {tok_dir}: its template has no {{% generation %}} markers and it is not a fast "
            "tokenizer (no offsets); provide a tokenizer.json"
        )

    # Scratch and the new dataset live beside OUT (same filesystem) so the final step is a rename.
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = out.parent / f".{out.name}.scratch-{os.getpid()}"
    staged_out = temp_path(out)
    try:
        source = open_chat_source(cfg.data, cfg.format, scratch)
        if len(source.dataset) == 0:
            raise ValueError(f"--data {cfg.data} holds no rows")
        encoder = ConversationEncoder(
            tokenizer_dir=str(tok_dir),
            key=source.key,
            raw_lines=source.raw_lines,
            use_markers=use_markers,
            last_turn_only=cfg.last_turn_only,
            max_len=cfg.max_len,
        )
        num_proc = min(cfg.num_proc, len(source.dataset))
        scratch.mkdir(parents=True, exist_ok=True)
        mapped = source.dataset.map(
            encoder,
            batched=True,
            batch_size=cfg.batch_size,
            input_columns=[source.column],
            remove_columns=source.dataset.column_names,
            features=_output_features(),
            num_proc=num_proc if num_proc > 1 else None,
            cache_file_name=str(scratch / "encoded.arrow"),
            new_fingerprint=f"dflash-tokenize-{os.getpid()}-{time.time_ns()}",
            desc="tokenize" if cfg.num_proc > 1 else None,
        )
        mask_source = "generation_markers" if use_markers else "char_offsets"
        summary = _summarize(mapped, cfg, source, mask_source, max_len_from, 0.0)
        kept = mapped.filter(
            lambda reasons: [r == "" for r in reasons],
            batched=True,
            batch_size=max(cfg.batch_size, 1000),
            input_columns=["skip_reason"],
            cache_file_name=str(scratch / "kept.arrow"),
            new_fingerprint=f"dflash-tokenize-kept-{os.getpid()}-{time.time_ns()}",
        )
        kept = kept.remove_columns(["supervised", "truncated", "skip_reason"])
        kept.save_to_disk(str(staged_out))
        summary["seconds"] = round(time.perf_counter() - start, 2)
        (staged_out / SUMMARY_NAME).write_text(json.dumps(summary, indent=2) + "\n")
        # Swap in the new dataset; an old one (--overwrite) is removed only once the new one is in place.
        commit_dir(staged_out, out)
    finally:
        for path in (scratch, staged_out):
            shutil.rmtree(path, ignore_errors=True)
    return summary


def format_summary(summary: dict) -> str:
    """The human-readable summary: a few lines, skipped rows by reason, truncation called out."""
    lines = [
        f"dflash-tokenize: {summary['rows_out']}/{summary['rows_in']} conversations -> {summary['out']} "
        f"({summary['input_form']}, {summary['format']}, mask from {summary['mask_source'].replace('_', ' ')})",
        f"  tokens {summary['tokens']:,}  supervised {summary['supervised_tokens']:,}  "
        f"mean length {summary['mean_seq_len']}  max length {summary['max_seq_len']}  {summary['seconds']} s",
    ]
    if summary["skipped"]:
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(summary["skipped"].items(), key=lambda kv: -kv[1]))
        lines.append(f"  skipped {summary['rows_skipped']}: {reasons}")
    if summary["max_len"] is not None:
        lines.append(f"  --max-len {summary['max_len']}: {summary['truncated_rows']} conversations truncated")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dflash-tokenize",
        description="Tokenize chat data (JSONL/Parquet/save_to_disk, OpenAI messages or ShareGPT conversations) "
        "into input_ids + assistant loss_mask + seq_len for dflash-extract.",
        formatter_class=DefaultsHelp,
    )
    p.add_argument(
        "--data",
        required=True,
        help="a .jsonl/.json(.gz) or .parquet file, a folder of them, or a save_to_disk dataset",
    )
    p.add_argument(
        "--tokenizer", required=True, help="HF tokenizer directory with a chat template (the target's)"
    )
    p.add_argument("--out", required=True, help="output directory (a datasets save_to_disk dataset)")
    p.add_argument(
        "--format", default="auto", choices=("auto", *FORMATS), help="conversation column (default: detect)"
    )
    p.add_argument("--last-turn-only", action="store_true", help="supervise only the last assistant turn")
    p.add_argument(
        "--max-len",
        type=int,
        default=None,
        help="truncate conversations to this many tokens (default: the model's max_position_embeddings from "
        "a config.json beside the tokenizer, else the tokenizer's model_max_length, else 32768)",
    )
    p.add_argument("--num-proc", type=int, default=1, help="worker processes (default 1)")
    p.add_argument(
        "--batch-size", type=int, default=256, help="conversations per tokenizer call (default 256)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing tokenized dataset at --out")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return p


def config_from_args(argv: Sequence[str] | None) -> TokenizeConfig:
    args = build_parser().parse_args(argv)
    return TokenizeConfig(**{k.replace("-", "_"): v for k, v in vars(args).items()})


def _main(argv: Sequence[str] | None) -> int:
    cfg = config_from_args(argv)
    import datasets

    if not sys.stderr.isatty():  # datasets' bars on a terminal only: in a log they are carriage returns
        datasets.disable_progress_bars()
    logging.getLogger("datasets").setLevel(logging.ERROR)
    summary = tokenize_chats(cfg)
    print(json.dumps(summary) if cfg.json else format_summary(summary))
    if summary["rows_out"] == 0:
        reasons = ", ".join(f"{r} {n}" for r, n in summary["skipped"].items())
        raise ValueError(
            f"no conversation was kept from {cfg.data} (skipped: {reasons}); see {cfg.out}/{SUMMARY_NAME}"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(_main, argv, "dflash-tokenize")


if __name__ == "__main__":
    sys.exit(main())
