"""Drafter quality on a target whose outputs mean something: is the drafter better than copying?

    python bench/bench_quality.py --quick                    # one H200: one seed, lossless and fp8 caches
    python bench/bench_quality.py --size full                # three seeds (fp8 vs lossless spread), data sizes

Time on one H200 (BENCHMARKS.md): target 140 s, data 61 s (`--unpack` a packed target and data to skip both),
extraction 48 s (fp8) / 76 s (lossless), side by side, then the runs side by side (each codec's as soon as its
cache is complete; --quick's two at 1500 steps, ~2.3 epochs: 552 s from scratch to the table with 3 drafter
layers, before the 5 it trains now; the recipe's measure is the full size's 6000) and their evaluations.
    python bench/bench_quality.py --size ci --device cpu     # seconds: every phase, tiny (CI runs this)
    python bench/bench_quality.py --size cpu --device cpu    # the development box: a real but small signal

`--target` picks the LM the drafters serve, each with its own prompt-lookup baseline (every size; --work keeps
code's phases, W/prose and W/hybrid the others', and --pack/--unpack name their parts after the target; a
GPU's extractions keep their Triton cache in the target's folder and --pack carries it too: the hybrid's
extraction took 222 s cold and 74 s with it):
    --target code      a Qwen3 LM on Python sources (the default; what the numbers above are)
    --target prose     the same shape on ChatML rows of docstrings and shipped docs (`quality_prose`): prompts
                       are a user turn and the start of its answer
    --target hybrid    Qwen3.5's text decoder (Gated DeltaNet and full attention layers, 3:1), code corpus, as
                       many parameters (FLA's kernels on a GPU, transformers' torch fallbacks on a CPU)

Longer than one call of a rationed machine (`--size full`: six 6000-step runs side by side trained ~21 min with 3
drafter layers, the sizes' depth before the 5 they train now):
start it detached (`setsid nohup python bench/bench_quality.py ... > W/bench.log 2>&1 &`) and read each run's
`W/runs/*/metrics.jsonl` from later calls while the machine is still held (two of three sessions' second calls
found a fresh machine instead: BENCHMARKS.md). The first codec's first seed
evaluates along the way (`eval_points`), the other runs at their end; `--train-args "--eval-every 1500"` makes
every run do so, so a cut leaves numbers behind (six evaluations at once: 25-42 s each).

Phases (each kept in --work and skipped when its output exists, so a cut-off run resumes where it stopped):
1. target: a byte-level BPE and a small LM trained on its corpus (`quality_target`), saved in bf16 with tied
   embeddings like released Qwen3-0.6B/1.7B/4B checkpoints;
2. data: prompts cut from training files (rows) and from held-out ones, the target's greedy continuations
   (what DFlash trains on: target-regenerated data) -> one Arrow file + the evaluation row ids;
3. caches: the real `dflash-extract` CLI per codec;
4. runs: the real `dflash-train` CLI (several at once on a GPU: small drafters leave it mostly idle), for
   every codec x seed on all training rows and, for the learning curve, on fractions of them; then
   `dflash-train export`;
5. evaluation, all on the same held-out rows: tau by sampled anchors and by the decode walk for the untrained
   drafter, every exported drafter, and prompt lookup (vLLM's `ngram`: n <= 4, k = B - 1).
Prints one table (after a line naming the target) and writes `quality.json` under the target's runs folder.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.quality_pack import nested_work, pack, target_work, unpack, work_mismatch
from bench.quality_phases import (
    extraction_summary,
    phase_cache,
    phase_data,
    phase_run,
    phase_target,
    stop_children_on_signals,
    unmade_caches,
    write_heldout_files,
)
from bench.quality_report import Scorer, data_order, print_table, summarize
from bench.quality_sizes import (
    NOW_DEFAULT_EPOCHS,
    SIZES,
    Run,
    parse_variants,
    plan_runs,
    starts_in_time,
    with_trainer_defaults,
)
from bench.quality_target import COMPILE_MODES, TARGET_KINDS, software


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="quick")
    p.add_argument("--target", choices=TARGET_KINDS, default="code",
                   help="the target LM: code (Qwen3 on Python), prose (Qwen3 on chat rows of docs), hybrid "
                   "(Qwen3.5's Gated DeltaNet + attention on Python); each but code works in --work/<target>")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="--size quick (one seed)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--work", default=".bench/quality", help="phase outputs (reused when present)")
    p.add_argument(
        "--codecs",
        help="comma-separated caches to extract and train on (default: the size's); a name that is no codec "
        "trains on the complete W/cache-NAME already there (a simulated codec: bench/simulate_codec.py)",
    )
    p.add_argument(
        "--score-on",
        help="the cache whose features score every drafter (default: lossless when trained on, else the first "
        "codec); extracted even when no run trains on it, so lossy caches' drafters are scored on exact states",
    )
    p.add_argument("--seeds", type=int, help="override the size's seed count")
    p.add_argument(
        "--first-seed", type=int, default=0, help="drafter seeds start here (add seeds to an earlier run's)"
    )
    p.add_argument("--fractions", help="comma-separated fractions of the training rows (default: the size's)")
    p.add_argument(
        "--runs-dir", default="runs", help="subfolder of --work for the training runs (an experiment name)"
    )
    p.add_argument("--parallel", type=int, help="training runs at once (default: the size's)")
    p.add_argument("--train-args", default="", help="extra dflash-train flags for every run")
    p.add_argument(
        "--variants", default="", help='recipes side by side: "name=FLAGS;name2=FLAGS" (default: one)'
    )
    p.add_argument(
        "--recipe", choices=("size", "defaults"), default="size",
        help="the drafters' recipe: the size's (what its recorded numbers trained), or dflash-train's own "
        "defaults as a new user runs them (its epochs set the length)",
    )  # fmt: skip
    p.add_argument("--steps", type=int, help="override the recipe's training steps")
    p.add_argument(
        "--curves", choices=("first", "all"), default="first",
        help="which runs evaluate along the way: the first codec's first seed (of each variant), or all "
        "(~7 s an evaluation on an H100; a device job cut short still has every pair at the steps both ran: "
        "bench/quality_curves.py)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the target and data")
    p.add_argument(
        "--gen-batch", type=int,
        help="rows generated at once (default: the size's); greedy decoding is bound by its steps, not its "
        "batch, so a larger one builds the rows sooner, and other rows (bf16 rounding depends on the batch)",
    )  # fmt: skip
    p.add_argument("--compile-target", nargs="?", const="default", choices=COMPILE_MODES, metavar="MODE",
                   help="torch.compile the target's training, in MODE (default: torch.compile's; H200, the "
                   "hybrid's full size: 2500 steps in 317 s with reduce-overhead, its compile ~150 s, 283 s eager)")  # fmt: skip
    p.add_argument(
        "--pack",
        help="write target/ and data/, then the extraction's Triton cache, as tar parts here (to carry "
        "them to another machine)",
    )
    p.add_argument("--unpack", help="start from tar parts written by --pack")
    p.add_argument("--stop-after", choices=("data", "extract"), help="end after this phase")
    p.add_argument("--json", help="also write the report here")
    p.add_argument(
        "--deadline", type=float,
        help="seconds from the start: start no run that the longest finished one says would end later (a "
        "device call's limit, less its own start); runs left out are reported as not started, not failed",
    )  # fmt: skip
    args = p.parse_args(argv)
    began = time.perf_counter()
    size_name = "quick" if args.quick else args.size
    size = SIZES[size_name]
    if args.seeds:
        size = replace(size, seeds=args.seeds)
    if args.fractions:
        size = replace(size, fractions=tuple(float(f) for f in args.fractions.split(",")))
    if args.recipe == "defaults":
        try:
            size = with_trainer_defaults(size)
        except ValueError as exc:
            raise SystemExit(f"error: --size {size_name}: {exc}") from None
    if args.steps:
        size = replace(size, drafter=replace(size.drafter, steps=args.steps))
    if args.gen_batch:
        size = replace(size, data=replace(size.data, gen_batch=args.gen_batch))
    size = replace(size, target=replace(size.target, kind=args.target, compile=args.compile_target))
    nested = None if args.unpack else nested_work(Path(args.work), args.target)
    if nested:
        raise SystemExit(f"error: --work {args.work}: {nested}")
    work = target_work(Path(args.work), args.target)
    work.mkdir(parents=True, exist_ok=True)
    if args.unpack and unpack(Path(args.unpack), work, args.target):
        print(f"unpacked target/ and data/ from {args.unpack}", flush=True)
    if args.unpack and unpack(Path(args.unpack), work, args.target, what="triton"):
        print(f"unpacked the extraction's Triton cache from {args.unpack}", flush=True)
    mismatch = work_mismatch(work, size)
    if mismatch:
        raise SystemExit(f"error: --size {size_name} --target {args.target}: {mismatch}; use another --work")
    unmade = unmade_caches(
        work, [*(args.codecs.split(",") if args.codecs else []), *filter(None, [args.score_on])]
    )
    if unmade:
        raise SystemExit(
            f"error: --codecs {','.join(unmade)}: no dflash codec, and no complete cache to train on at "
            f"{', '.join(str(work / f'cache-{c}') for c in unmade)} (bench/simulate_codec.py writes one)"
        )
    seconds: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        t = time.perf_counter()
        value = fn()
        seconds[name] = round(time.perf_counter() - t, 1)
        print(f"[{name}] {seconds[name]:.0f} s", flush=True)
        return value

    info, tokenizer, train_files, held_files = timed(
        "target", lambda: phase_target(work, size, args.device, args.seed)
    )
    meta = timed(
        "data", lambda: phase_data(work, size, tokenizer, train_files, held_files, args.device, args.seed)
    )
    if args.pack:
        print(f"packed: {[str(x) for x in pack(work, Path(args.pack), kind=args.target)]}", flush=True)
    codecs = args.codecs.split(",") if args.codecs else list(size.codecs)
    if args.stop_after == "data":
        return 0
    scored_on = args.score_on or ("lossless" if "lossless" in codecs else codecs[0])
    # One extraction per codec, side by side: each leaves most of the box idle (per-row work bounds it, not
    # the target's forward nor the disk), and each codec's runs start as soon as its own cache is complete.
    extracted = list(dict.fromkeys([*codecs, scored_on]))
    extractor = ThreadPoolExecutor(len(extracted), thread_name_prefix="extract")
    caches = {
        c: extractor.submit(
            timed, f"extract {c}", partial(phase_cache, work, c, args.device, size.extract_token_budget)
        )
        for c in extracted
    }

    def pack_triton() -> None:
        if args.pack:  # after the extractions: their Triton cache is complete
            print(f"packed: {[str(x) for x in pack(work, Path(args.pack), kind=args.target, what='triton')]}")

    if args.stop_after == "extract":
        extractor.shutdown(wait=True)
        pack_triton()
        return 0 if all(f.exception() is None for f in caches.values()) else 1
    variants = parse_variants(args.variants)
    runs = plan_runs(work / args.runs_dir, size, codecs, variants, args.first_seed, args.curves == "all")
    write_heldout_files(work / args.runs_dir, meta, size.fractions)
    extra = args.train_args.split()

    scorer = Scorer(work, size, meta, args.device, scored_on)

    took: list[float] = []  # each finished run's seconds, training to score

    def train_one(run: Run) -> Run:
        try:
            caches[run.codec].result()
            if args.deadline:
                left = args.deadline - (time.perf_counter() - began)
                if not starts_in_time(left, took):
                    run.result["not_started"] = (
                        f"{left:.0f} s left before --deadline, a run took {max(took):.0f} s"
                    )
                    print(f"[run] {run.name} not started: {run.result['not_started']}", flush=True)
                    return run
            run_began = time.perf_counter()
            phase_run(run, work, size, meta, args.device, extra)
            print(f"[run] {run.name} done ({run.result['train_seconds']:.0f} s)", flush=True)
            caches[scored_on].result()
            scorer.score(run)
            took.append(time.perf_counter() - run_began)
        except Exception as exc:  # one failed recipe must not cost the others
            run.result["error"] = str(exc)
            print(f"[run] {run.name} FAILED: {exc}", flush=True)
        return run

    with ThreadPoolExecutor(args.parallel or size.parallel_runs) as pool:
        runs = timed("train", lambda: list(pool.map(train_one, runs)))
    extractor.shutdown(wait=True)
    pack_triton()
    good = [r for r in runs if "error" not in r.result and "not_started" not in r.result]
    scorer.close()
    seconds["evaluate (during train)"] = round(scorer.seconds, 1)
    baselines = scorer.baselines
    report = {
        "target_kind": args.target,
        "size": asdict(size),
        "target": info,
        "data": {k: v for k, v in meta.items() if k != "eval_rows"},
        "baselines": baselines,
        "table": summarize(runs, baselines) if good else [],
        "curves": [{"run": r.name, "points": r.result["curve"]} for r in good if r.curve],
        "runs": [{"run": r.name, "flags": list(r.flags), **r.result} for r in runs],
        "recipe": args.recipe,
        "train_args": args.train_args,
        "scored_on": scored_on,
        "data_order": data_order(good),
        "default_epochs": NOW_DEFAULT_EPOCHS,  # what a run without --epochs trained for (quality_merge compares)
        "run_with": software(args.device),
        "seconds": seconds,
        "extractions": {c: extraction_summary(work, c) for c in extracted},
    }
    (work / args.runs_dir / "quality.json").write_text(json.dumps(report, indent=1) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    recipe = "dflash-train's defaults" if args.recipe == "defaults" else "the size's"
    print(f"target {args.target}: {info['params'] / 1e6:.1f}M params, LM loss {info['first_loss']:.2f} -> {info['final_loss']:.2f} "
          f"({info['train_tokens'] / 1e6:.1f}M tokens, {info['seconds']:.0f} s); data: {meta['rows']} rows, "
          f"{meta['tokens'] / 1e6:.2f}M tokens; corpus sha256 {str(info['corpus'].get('sha256'))[:16]}, "
          f"weights sha256 {str(info.get('weights_sha256'))[:16]}, rows sha256 {str(meta.get('rows_sha256'))[:16]}; "
          f"recipe: {recipe}")  # fmt: skip
    if good:
        print_table(report)
    return 1 if any("error" in r.result for r in runs) else 0


if __name__ == "__main__":
    stop_children_on_signals()  # the command's own process only: tests call main() in theirs
    sys.exit(main())
