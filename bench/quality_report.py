"""The quality benchmark's scoring and its table: every exported drafter and prompt lookup evaluated on the same
held-out rows (`Scorer`), then one row per recipe variant x codec x data size (`summarize`, `print_table`).

Each run (quality.json's `runs`) also carries the evaluation's split by what prompt lookup accepts on the same
anchor (`walk_split_*`, see `dflash.train.lookup_split`) and `tau_walk_max`, the walk of max(drafter, lookup)
per anchor. After the main table `print_table` shows each lossy codec and each recipe variant against its
reference run of the same seed (`quality_gaps`), then these per run (`print_split_table`)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash.train.verdict import evaluations, trend

from bench.quality_gaps import print_gaps
from bench.quality_sizes import OLD_ORDER, Run, Size

# dflash.train.lookup_split.CLASSES, spelled out: the report module imports no torch until a run is scored.
SPLIT_CLASSES = ("full", "part", "none")

# --- evaluation ---------------------------------------------------------------------------------------


class Scorer:
    """Every drafter and prompt lookup on the same held-out rows and anchors (the trainer's evaluation). Each
    run is scored as soon as it is exported; the first one also computes the baselines (the untrained
    drafter, prompt lookup), so little evaluation is left once the last run ends."""

    KEEP = (
        "tau", "tau_walk", "tau_walk_lookup", "tau_walk_max", "eval_loss", "eval_samples",
        "tau_walk_se", "walk_rows", "acceptance_per_position", "walk_split_anchors",
        *(f"walk_split_{c}_{m}" for c in SPLIT_CLASSES for m in ("share", "drafter", "lookup", "drafter_full")),
    )  # fmt: skip

    def __init__(self, work: Path, size: Size, meta: dict[str, Any], device: str, codec: str) -> None:
        self.work, self.size, self.rows, self.device = work, size, frozenset(meta["eval_rows"]), device
        self.codec = codec  # whose cache's features every drafter is scored on (lossless when there is one)
        self.baselines: dict[str, Any] = {}
        self.seconds = 0.0
        self._lock = threading.Lock()
        self._stack = contextlib.ExitStack()

    def score(self, run: Run) -> None:
        from dflash.train.export import load_drafter

        with self._lock:
            start = time.perf_counter()
            drafter = load_drafter(run.dir / "final")
            if not self.baselines:
                self._open(drafter.config)
            run.result.update(self._score(drafter))
            self.seconds += time.perf_counter() - start

    def close(self) -> None:
        self._stack.close()

    def _spec(self, c: Any) -> Any:
        """The evaluation spec for drafters of config `c`. Its gamma is the paper's whatever a run trained with:
        tau does not depend on it, and `eval_loss` then weighs the slots alike for every recipe variant."""
        from dflash.train.config import default_gamma
        from dflash.train.data_spec import DataSpec

        recipe = self.size.drafter
        return DataSpec(layer_ids=c.target_layer_ids, block_size=c.block_size, mask_token_id=c.mask_token_id,
                        num_anchors=recipe.num_anchors, gamma=default_gamma(c.block_size),
                        token_budget=recipe.token_budget, max_length=recipe.token_budget,
                        heldout_rows=self.rows, eval_samples=len(self.rows))  # fmt: skip

    def _score(self, drafter: Any) -> dict[str, Any]:
        import torch
        from dflash.train.evaluate import evaluate

        dev = torch.device(self.device)
        result = evaluate(drafter.to(device=dev, dtype=torch.float32), self.frozen, self.cache, self.eval_set,
                          self._spec(drafter.config), device=dev, per_row=True)  # fmt: skip
        return {k: result[k] for k in self.KEEP if k in result}

    def _open(self, config: Any) -> None:
        """Cache, frozen target, evaluation rows and the baselines, for drafters of `config`'s shape."""
        import torch
        from dflash.shards import Cache
        from dflash.shards.target_files import check_target_files
        from dflash.train.evaluate import build_eval_set
        from dflash.train.frozen import load_frozen_target
        from dflash.train.lookup import lookup_accepted
        from dflash.train.model import DFlashDrafter

        self.cache = cache = self._stack.enter_context(Cache.open(self.work / f"cache-{self.codec}"))
        check_target_files(cache.path, cache.manifest.target_files)  # as training does before reading it
        self.frozen = load_frozen_target(cache.path).to(device=torch.device(self.device), dtype=torch.float32)
        self.eval_set = build_eval_set(cache, self._spec(config))  # the rows do not depend on the drafter
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            untrained = self._score(DFlashDrafter(config))
        # Prompt lookup over every anchor of the same rows; its decode walk comes with every evaluation.
        sampled = []
        for batch in self.eval_set.batches:
            for ref in batch:
                sample = cache.shard(ref.shard).read(ref.index, [cache.layers[0]])
                accepted = lookup_accepted(
                    sample.input_ids.numpy(), sample.loss_mask.numpy(), self.size.drafter.block_size - 1
                )
                sampled += (accepted[accepted >= 0] + 1).tolist()
        lookup = {"tau": float(np.mean(sampled)), "tau_walk": untrained["tau_walk_lookup"],
                  "eval_samples": self.eval_set.num_samples}  # fmt: skip
        self.baselines.update(untrained=untrained, prompt_lookup=lookup)


# --- report -------------------------------------------------------------------------------------------


def data_order(runs: list[Run]) -> str:
    """The epoch order the runs trained on (`dflash-train --data-order`), "mixed" when they differ: codec pairs
    share their batches on `spans` only (`bench/quality_gaps.py`)."""
    orders = {run.result.get("data_order", OLD_ORDER) for run in runs}
    return orders.pop() if len(orders) == 1 else "mixed"


def summarize(runs: list[Run], base: dict[str, Any]) -> list[dict[str, Any]]:
    """One table row per (variant, codec, fraction): mean and spread over seeds, against prompt lookup and
    (a codec's cost) against the lossless cache's drafters of the same variant and fraction."""
    keys = sorted({(r.variant, r.codec, r.fraction) for r in runs}, key=lambda k: (k[0], k[1], -k[2]))
    by_key: dict[tuple[str, str, float], dict[str, Any]] = {}
    for key in keys:
        name = f"{key[0]}: {key[1]}, {key[2]:.0%} rows"
        of_key = [r for r in runs if (r.variant, r.codec, r.fraction) == key]
        group = [r for r in of_key if "tau" in r.result]
        if not group:
            skipped = all("not_started" in r.result for r in of_key)
            by_key[key] = {"drafter": name, "not_started" if skipped else "failed": True}
            continue
        taus = np.array([r.result["tau"] for r in group])
        walks = np.array([r.result["tau_walk"] for r in group])
        by_key[key] = {
            "drafter": name, "seeds": len(group),
            "tau": float(taus.mean()), "tau_spread": float(taus.max() - taus.min()),
            "tau_walk": float(walks.mean()), "tau_walk_spread": float(walks.max() - walks.min()),
            "vs_lookup": float(walks.mean() / base["prompt_lookup"]["tau_walk"]),
            # the bar (1.3x prompt lookup) holds per seed: the worst seed's ratio beside the mean's
            "vs_lookup_worst": float(walks.min() / base["prompt_lookup"]["tau_walk"]),
            **({"tau_walk_max": float(np.mean([r.result["tau_walk_max"] for r in group]))}
               if all("tau_walk_max" in r.result for r in group) else {}),
            "train_s": float(np.mean([r.result["train_seconds"] for r in group])),
        }  # fmt: skip
    for (variant, _, fraction), row in by_key.items():
        ref = by_key.get((variant, "lossless", fraction), {})
        if "tau_walk" in ref and "tau_walk" in row:
            row["vs_lossless"] = row["tau_walk"] / ref["tau_walk"] - 1
    return list(by_key.values())


def print_table(report: dict[str, Any]) -> None:
    base = report["baselines"]
    print(f"\nheld-out rows: {base['prompt_lookup']['eval_samples']} (from files no model trained on); "
          f"block size {report['size']['drafter']['block_size']}")  # fmt: skip
    print(
        f"{'drafter':<34} {'seeds':>5} {'tau (anchors)':>16} {'tau (walk)':>16} {'walk/lookup':>11} "
        f"{'worst seed':>10} {'vs lossless':>11} {'train s':>8}"
    )
    lookup = base["prompt_lookup"]
    print(
        f"{'prompt lookup (n<=4)':<34} {'-':>5} {lookup['tau']:>16.3f} {lookup['tau_walk']:>16.3f} {1.0:>11.2f} "
        f"{'-':>10} {'-':>11} {'-':>8}"
    )
    untrained = base["untrained"]
    print(f"{'untrained drafter':<34} {'-':>5} {untrained['tau']:>16.3f} {untrained['tau_walk']:>16.3f} "
          f"{untrained['tau_walk'] / lookup['tau_walk']:>11.2f} {'-':>10} {'-':>11} {'-':>8}")  # fmt: skip
    for row in report["table"]:
        if row.get("failed") or row.get("not_started"):
            why = "FAILED (see its log under --work)" if row.get("failed") else "not started (--deadline)"
            print(f"{row['drafter']:<34} {why}")
            continue
        print(f"{row['drafter']:<34} {row['seeds']:>5} {row['tau']:>9.3f} ±{row['tau_spread']:<5.3f} "
              f"{row['tau_walk']:>9.3f} ±{row['tau_walk_spread']:<5.3f} {row['vs_lookup']:>11.2f} "
              f"{_ratio(row.get('vs_lookup_worst')):>10} {_signed_pct(row.get('vs_lossless')):>11} "
              f"{row['train_s']:>8.0f}")  # fmt: skip
    print_gaps(report)
    print_split_table(report)
    for curve in report["curves"]:
        points = ", ".join(
            f"{p['step']}: {p['tau']:.2f}/{p.get('tau_walk', float('nan')):.2f}" for p in curve["points"]
        )
        print(f"tau/tau_walk vs steps ({curve['run']}): {points}{_schedule(curve['points'])}")
    if report["seconds"]:  # a merged report has no phases of its own
        print("phases (s): " + ", ".join(f"{k} {v:.0f}" for k, v in report["seconds"].items()))


def _ratio(value: float | None) -> str:
    """A walk / lookup ratio to three places ('1.296': the 1.3x bar is that close), or '-' (older reports)."""
    return "-" if value is None else f"{value:.3f}"


def _schedule(points: list[dict[str, Any]]) -> str:
    """'; still rising: +2.3% from step 3000' / '; peaked at step 2000, +1.1% over the end' (as dflash-train
    reads its own run, `dflash.train.verdict.trend`), or nothing for a flat end."""
    seen = trend(evaluations(points))
    if seen is None:
        return ""
    if seen.kind == "rising":
        return f"; still rising: {seen.change:+.1%} from step {seen.since.step}"
    return f"; peaked at step {seen.since.step}, {seen.change:+.1%} over the end"


def _signed_pct(x: float | None) -> str:
    """'+1.2%', or '-' where there is no lossless run to compare with."""
    return "-" if x is None else f"{x:+.1%}"


def print_split_table(report: dict[str, Any]) -> None:
    """Per run: per class of what prompt lookup accepts at an anchor, the share of anchors, the drafter's and
    lookup's mean accepted tokens and how often the drafter accepted the whole block; then the max walk."""
    whole = report["size"]["drafter"]["block_size"] - 1
    runs = [("untrained drafter", report["baselines"]["untrained"])]
    runs += [(r["run"], r) for r in report["runs"] if "walk_split_anchors" in r]
    if len(runs) == 1 or "walk_split_anchors" not in runs[0][1]:
        return  # a report from before the split
    heads = (f"lookup all {whole}", f"lookup 1-{whole - 1}", "lookup 0")
    print(
        f"\nper anchor, by what prompt lookup accepts of the block's {whole} tokens: share of anchors, "
        f"drafter/lookup mean accepted tokens, drafter's whole-block share; max walk = max(drafter, lookup)"
    )
    print(f"{'run':<34} " + " ".join(f"{h:<23}" for h in heads) + f" {'max walk':>8}")  # fmt: skip
    for name, result in runs:
        cells = []
        for c in SPLIT_CLASSES:
            key = f"walk_split_{c}"
            if f"{key}_drafter" not in result:
                cells.append(f"{result.get(f'{key}_share', 0.0):>4.0%}{'-':>19}")
                continue
            cells.append(f"{result[f'{key}_share']:>4.0%} {result[f'{key}_drafter']:>5.2f}/"
                         f"{result[f'{key}_lookup']:<5.2f} {result[f'{key}_drafter_full']:>5.0%}")  # fmt: skip
        print(
            f"{name:<34} "
            + " ".join(f"{c:<23}" for c in cells)
            + f" {result.get('tau_walk_max', float('nan')):>8.3f}"
        )
