"""`dflash-demo`: the whole pipeline on this machine in a few minutes, with nothing downloaded.

Steps, each printed as one line with its wall and CPU seconds:

    target    build the tiny Qwen3 target + tokenizer (`tiny.build_tiny_target`), kept as a full HF dir
    data      the target answers the built-in prompts greedily (target-regenerated data) -> chats.jsonl
    tokenize  `dflash-tokenize` in-process -> dataset/
    extract   `dflash-extract` in-process (every target layer, lossless codec, fp32 on the CPU) -> cache/
    before    tau of the untrained drafter: the exact step-0 weights the trainer starts from
    train     `dflash-train` in-process -> run/ (metrics, plots, checkpoints, run/export = best by decode walk)
    after     tau of the exported drafter, loaded back from run/export, on the same held-out blocks

Both evaluations use the trainer's own evaluation (held-out rows, fixed anchors, decode walk), so
`tau_before` and `tau_after` compare the same blocks. Everything is seeded and runs on one CPU thread,
so two runs print the same numbers. What the steps print themselves (progress lines included) goes to
`OUT/logs/STEP.log`; while a step runs, the console repeats its latest line every few seconds
(`demo_steps.py`). The tokenize, extract and train steps are parsed from the CLI command lines
`demo_commands.py` builds: the demo prints them, and `OUT/summary.json` holds them with the taus, the
paths and the timings. The exported drafter's decode walk (bf16 weights) can differ from the best walk
training logged (fp32 weights); the `after` line then prints both.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash.shards.cli import DefaultsHelp, run_main
from dflash.shards.outdir import claim_out_dir
from dflash.shards.threads import torch_threads

from .demo_steps import Steps

PROG = "dflash-demo"
MARKER = ".dflash-demo"  # written first: --overwrite only ever deletes a directory that holds it
SUMMARY_NAME = "summary.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoSize:
    """How much work each step does. `DEMO_SIZES` holds the presets."""

    target_size: str  # a `tiny.SIZES` key
    num_prompts: int
    max_new_tokens: int
    train_steps: int
    eval_every: int
    token_budget: int  # context tokens per training batch; the CPU attention cost grows with its square
    max_length: int
    num_draft_layers: int
    block_size: int
    num_anchors: int
    lr: float
    eval_fraction: float
    eval_samples: int

    def __post_init__(self) -> None:
        for name in ("num_prompts", "max_new_tokens", "train_steps", "eval_every", "num_draft_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"DemoSize.{name} must be >= 1, got {getattr(self, name)}")
        if self.token_budget < self.max_length:
            raise ValueError(f"token_budget {self.token_budget} must be >= max_length {self.max_length}")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(
                f"eval_fraction must be in (0, 1) (tau needs held-out rows), got {self.eval_fraction}"
            )


DEMO_SIZES: dict[str, DemoSize] = {
    # Measured on the shared 2-core box, one thread: 107 s wall (~110 s CPU), of which ~77 s train and
    # ~21 s target build (203 s wall under load from other jobs); tau 1.00 -> 4.42 (sampled anchors),
    # 1.00 -> 3.24 (decode walk) against prompt lookup's 1.32.
    "full": DemoSize(
        target_size="demo",
        num_prompts=1024,
        max_new_tokens=64,
        train_steps=1000,
        eval_every=250,
        token_budget=256,
        max_length=128,
        num_draft_layers=2,
        block_size=8,
        num_anchors=16,
        lr=6e-3,
        eval_fraction=0.1,
        eval_samples=32,
    ),
    # For tests and a quick look: the test-size target, seconds per step.
    "quick": DemoSize(
        target_size="test",
        num_prompts=192,
        max_new_tokens=32,
        train_steps=120,
        eval_every=60,
        token_budget=256,
        max_length=128,
        num_draft_layers=1,
        block_size=8,
        num_anchors=16,
        lr=6e-3,
        eval_fraction=0.1,
        eval_samples=16,
    ),
}


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    """Every setting of `dflash-demo`, checked up front."""

    out: str = "dflash_demo"
    size: str | DemoSize = "full"
    overwrite: bool = False
    seed: int = 0
    threads: int = 1  # tiny matrices: one thread beats two on a 2-core box (no contention, no sync)
    verbose: bool = False  # let the steps' own output through instead of OUT/logs/
    spec: DemoSize = field(init=False)

    def __post_init__(self) -> None:
        if isinstance(self.size, DemoSize):
            self.spec = self.size
        elif self.size in DEMO_SIZES:
            self.spec = DEMO_SIZES[self.size]
        else:
            raise ValueError(f"unknown demo size {self.size!r}; choose one of {sorted(DEMO_SIZES)}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if not self.out:
            raise ValueError("out is empty: pass --out DIR")
        out = Path(self.out)
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out} is a file; choose a directory")
        if out.is_dir() and any(out.iterdir()):
            if not self.overwrite:
                raise ValueError(f"--out {out} is not empty; choose another directory or pass --overwrite")
            if not (out / MARKER).is_file():
                raise ValueError(
                    f"--out {out} is not empty and was not written by {PROG}; refusing to overwrite it"
                )


def _prepare_out(cfg: DemoConfig) -> Path:
    out = Path(cfg.out).resolve()
    if out.is_dir() and any(out.iterdir()):  # DemoConfig checked --overwrite and the marker
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text(f"written by {PROG}; {PROG} --overwrite may delete this directory\n")
    return out


def _fmt_tau(result: dict[str, Any]) -> str:
    walk, lookup = result.get("tau_walk"), result.get("tau_walk_lookup")
    text = f"tau {result['tau']:.2f} (sampled anchors)" + (f", {walk:.2f} (decode walk)" if walk else "")
    return text + (f"; prompt lookup walks {lookup:.2f} on the same rows" if lookup else "")


def _export_note(exported: float | None, best: float | None) -> str:
    """Why the exported drafter's decode walk is not the best one training logged, when they differ: the
    export holds the best step's weights in bf16 (what servers load), training evaluated them in fp32."""
    if best is None or exported is None or best == exported:
        return ""
    return (
        f" (bf16 weights, as served: decode walk {exported:.3f}; training measured {best:.3f} on the same "
        "rows with the same step's fp32 weights)"
    )


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Run every step into `cfg.out`; returns the summary (also written to `OUT/summary.json`)."""
    from dflash.train.cli import build_config, run_verdict
    from dflash.train.metrics import METRICS_FILE

    from .demo_commands import command_line, extract_argv, tokenize_argv, train_argv
    from .demo_eval import cached_layers, evaluate_drafter, untrained_drafter

    spec = cfg.spec
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    out = _prepare_out(cfg)
    paths = {
        "target": out / "target",
        "chats": out / "chats.jsonl",
        "dataset": out / "dataset",
        "cache": out / "cache",
        "run": out / "run",
    }
    paths["export"] = paths["run"] / "export"
    paths["plots"] = paths["run"] / "plots"
    steps = Steps(out, cfg.verbose)
    argvs = {  # each step's command line; the steps' configs are parsed from them (demo_commands)
        "tokenize": tokenize_argv(paths["chats"], paths["target"], paths["dataset"]),
        "extract": extract_argv(paths["target"], paths["dataset"], paths["cache"], spec),
    }
    print(f"{PROG}: tiny pipeline into {out} (size {cfg.size if isinstance(cfg.size, str) else 'custom'})")
    with torch_threads(cfg.threads):
        from dflash.extract.cli import config_from_args
        from dflash.extract.pipeline import run_extraction
        from dflash.train.loop import train

        from . import tiny
        from .tokenize import config_from_args as tokenize_config
        from .tokenize import tokenize_chats

        info = steps.run(
            "target",
            lambda: tiny.build_tiny_target(paths["target"], size=spec.target_size, seed=cfg.seed),
            lambda i: (
                f"tiny Qwen3 target: {i.num_parameters / 1e6:.2f}M params, {i.vocab_size} vocab, "
                f"LM loss {i.first_loss:.2f} -> {i.final_loss:.2f} -> {paths['target']}"
            ),
        )

        def answer() -> int:
            prompts = tiny.builtin_prompts(spec.num_prompts, seed=cfg.seed + 1)
            chats = tiny.generate_completions(paths["target"], paths["target"], prompts, spec.max_new_tokens)
            tiny.write_chat_jsonl(chats, paths["chats"])
            return len(chats)

        steps.run("data", answer, lambda n: f"the target answered {n} prompts greedily -> {paths['chats']}")
        tokenized = steps.run(
            "tokenize",
            lambda: tokenize_chats(tokenize_config(argvs["tokenize"])),
            lambda s: (
                f"{s['rows_out']} rows, {s['tokens']} tokens ({s['supervised_tokens']} supervised) "
                f"-> {paths['dataset']}"
            ),
        )
        extracted = steps.run(
            "extract",
            lambda: run_extraction(config_from_args(argvs["extract"])),
            lambda r: (
                f"{r.rows} rows, {r.tokens} tokens, every layer, lossless: {r.size.text()} -> {paths['cache']}"
            ),
        )
        argvs["train"] = train_argv(
            paths["cache"], paths["run"], spec, seed=cfg.seed, layers=cached_layers(paths["cache"])
        )
        train_cfg = build_config(argvs["train"])
        before = steps.run(
            "before",
            lambda: evaluate_drafter(untrained_drafter(train_cfg), train_cfg),
            lambda r: f"untrained drafter: {_fmt_tau(r)}",
        )
        # The logger keeps a fresh run's records up to step 0, so the plots start from the untrained drafter.
        claim_out_dir(paths["run"], "run")  # marked as a run: dflash-train then accepts the record below
        (paths["run"] / METRICS_FILE).write_text(json.dumps({"step": 0, **before}) + "\n")
        trained = steps.run(
            "train",
            lambda: train(train_cfg),
            lambda t: (
                f"{t.step} steps, final loss {t.final_metrics.get('loss', float('nan')):.3f}, "
                f"best decode walk {t.best_walk or float('nan'):.2f} -> {paths['run']}"
            ),
        )
        after = steps.run(
            "after",
            lambda: evaluate_drafter(paths["export"], train_cfg),
            lambda r: f"exported drafter: {_fmt_tau(r)}{_export_note(r.get('tau_walk'), trained.best_walk)}",
        )
    plots = sorted(str(p) for p in paths["plots"].glob("*.png"))
    summary = {
        "tau_before": before["tau"],
        "tau_after": after["tau"],
        "tau_walk_before": before.get("tau_walk"),
        "tau_walk_after": after.get("tau_walk"),
        "eval_before": before,
        "eval_after": after,
        **{name: str(path) for name, path in paths.items()},
        "plot_files": plots,
        "target_info": asdict(info),
        "tokenize": tokenized,
        "extract": extracted.to_dict(),
        "train_steps": trained.step,
        # RUN/export holds the best step's weights in bf16 (what servers load): its walk can differ from the
        # one training measured on the fp32 weights by bf16's rounding.
        "tau_walk_best_in_training": trained.best_walk,
        # what dflash-train ends with: the walk against prompt lookup's, and the schedule's reading
        "verdict": run_verdict(train_cfg),
        "commands": {name: command_line(f"dflash-{name}", argv, cfg.threads) for name, argv in argvs.items()},
        "size": asdict(spec),
        "seed": cfg.seed,
        "timings": steps.timings,
        "seconds": round(time.perf_counter() - start_wall, 2),
        "cpu_seconds": round(time.process_time() - start_cpu, 2),
    }
    (out / SUMMARY_NAME).write_text(json.dumps(summary, indent=2) + "\n")
    _print_closing(summary)
    return summary


def _print_closing(s: dict[str, Any]) -> None:
    walk = ""
    if s["tau_walk_before"] and s["tau_walk_after"]:
        walk = f"; decode walk {s['tau_walk_before']:.2f} -> {s['tau_walk_after']:.2f}"
        if s["eval_after"].get("tau_walk_lookup"):
            walk += f" (prompt lookup: {s['eval_after']['tau_walk_lookup']:.2f})"
    print(
        f"\ntau (mean accepted tokens per draft, held-out rows): {s['tau_before']:.2f} untrained -> "
        f"{s['tau_after']:.2f} trained (sampled anchors){walk}"
    )
    for line in s["verdict"][1:]:  # the schedule's reading (the first line repeats the walks above)
        print(line)
    print(f"plots:    {', '.join(s['plot_files']) or '(none)'}")
    print(f"drafter:  {s['export']}")
    print("the same steps from the command line (the demo runs them in-process; use a new --out):")
    for line in s["commands"].values():
        print(f"  {line}")
    print(
        f"summary:  {Path(s['run']).parent / SUMMARY_NAME}  ({s['seconds']:.0f} s, CPU {s['cpu_seconds']:.0f} s)"
    )
    print("serve it (on a GPU machine, with the target it was trained for):")
    print(
        f"  python -m sglang.launch_server --model-path {s['target']} "
        f"--speculative-algorithm DFLASH --speculative-draft-model-path {s['export']}"
    )
    # A block of B tokens is the anchor plus B - 1 drafted tokens (15 for the paper's B = 16).
    drafted = s["size"]["block_size"] - 1
    spec = json.dumps({"method": "dflash", "model": s["export"], "num_speculative_tokens": drafted})
    print(f"  vllm serve {s['target']} --speculative-config '{spec}'")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Build a tiny target, regenerate data with it, tokenize, extract, train, evaluate and "
        "export a DFlash drafter: the whole pipeline on a CPU in a few minutes, nothing downloaded.",
        formatter_class=DefaultsHelp,
    )
    p.add_argument("--out", default="dflash_demo", help="output directory (default: ./dflash_demo)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier demo's --out directory")
    p.add_argument("--quick", action="store_true", help="a reduced demo (smaller target, fewer steps)")
    p.add_argument("--seed", type=int, default=0, help="seeds the target, the prompts and the drafter")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--verbose", action="store_true", help="show the steps' own output (else OUT/logs/)")
    return p


def main_impl(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    cfg = DemoConfig(
        out=args.out,
        size="quick" if args.quick else "full",
        overwrite=args.overwrite,
        seed=args.seed,
        threads=args.threads,
        verbose=args.verbose,
    )
    run_demo(cfg)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(main_impl, argv, PROG)


if __name__ == "__main__":
    sys.exit(main())
