"""One table from quality reports of the same target, rows and recipe written by different sessions (a device
call fits a seed or two, the issue's criteria want three):

    python bench/quality_merge.py bench/reports/hybrid-defaults-codecs-s0.json \
        bench/reports/hybrid-defaults-codecs-s1.json [--json merged.json] [--across-rows]

Reports merge only where their drafters were trained and scored alike: the same target weights, training rows,
held-out rows (prompt lookup's walk on them), recipe, drafter size, scoring cache and extra dflash-train flags
(but those that change only speed: `SPEED_ONLY`); anything else is refused in one line naming the field and both
files. Each run may appear in one report only. The merged report prints
as `bench_quality.py` prints its own: mean and spread over every seed, and each lossy codec and recipe variant
against its reference run of the same seed (`quality_gaps`).

`--across-rows` merges reports whose target was rebuilt: the same weights, but other training and held-out rows (the
target's greedy continuations are not bit for bit the same on every machine, BENCHMARKS.md). Their walks are on
different rows and are not averaged; what is still comparable is each seed's paired gap, computed between runs of
one report's rows. So it prints the gap tables and each rows instance's walks on their own, and refuses a seed
that appears on two instances (its pair would straddle them)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.quality_gaps import print_gaps
from bench.quality_report import print_table, summarize
from bench.quality_sizes import OLD_DEFAULT_EPOCHS, OLD_ORDER, Run

# What makes two reports' rows the same instance: (what it is, where it is in a report).
SAME_ROWS = (
    ("training rows", ("data", "rows_sha256")),
    ("held-out rows (prompt lookup's walk on them)", ("baselines", "prompt_lookup", "tau_walk")),
)

# What makes two reports' drafters comparable: (what it is, where it is in a report).
SAME = (
    ("target weights", ("target", "weights_sha256")),
    *SAME_ROWS,
    ("held-out row count", ("baselines", "prompt_lookup", "eval_samples")),
    ("recipe", ("recipe",)),
    ("drafter size", ("size", "drafter")),
    ("scoring cache", ("scored_on",)),
    # since `spans`, a seed's runs on two codecs train on the same batches; before, each cache's shards gave its own
    ("data order", ("data_order",)),
    # a run on dflash-train's defaults trained 6 epochs before 2026-12-07, and 6 to 10 by the cache's size since
    ("dflash-train default length", ("default_epochs",)),
)


# dflash-train flags that change how fast a run goes, not what it trains (the loader's batches are the same bit
# for bit with any number of workers or threads: tests/test_loader_procs.py): reports may differ in these.
SPEED_ONLY = {"--loader-workers": 1, "--loader-threads": 1, "--prefetch-batches": 1, "--log-every": 1,
              "--no-tensorboard": 0, "--no-plots": 0}  # fmt: skip


def recipe_flags(train_args: str | None) -> list[str]:
    """A report's extra dflash-train flags less the speed-only ones (with their values)."""
    words, kept = shlex.split(train_args or ""), []
    while words:
        word = words.pop(0)
        name = word.split("=", 1)[0]
        if name in SPEED_ONLY:
            del words[: SPEED_ONLY[name] if "=" not in word else 0]
        else:
            kept.append(word)
    return kept


# What a merged report takes from its first report (runs from all); a report lacking one is none.
KEPT = ("target_kind", "size", "target", "data", "baselines", "recipe", "scored_on", "runs")


def _at(report: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        report = report.get(key) if isinstance(report, dict) else None
    return report


def read_report(path: Path) -> dict[str, Any]:
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: {path}: not a readable quality report ({exc})") from None
    missing = [k for k in KEPT if not isinstance(report, dict) or k not in report]
    if missing or not isinstance(report["runs"], list):
        raise SystemExit(f"error: {path}: not a quality report (no {', '.join(missing) or 'list of runs'})")
    for entry in report["runs"]:
        name = entry.get("run") if isinstance(entry, dict) else None
        try:
            Run.from_report(entry)
        except (AttributeError, KeyError, TypeError, ValueError):
            raise SystemExit(
                f"error: {path}: run {name!r} is not named VARIANT-CODEC-fFRACTION-sSEED"
            ) from None
        if "walk_rows" in entry and not _row_walks(entry["walk_rows"]):
            raise SystemExit(f"error: {path}: run {name!r}: walk_rows is not row id -> [tokens, steps]")
    report.setdefault("data_order", OLD_ORDER)
    report.setdefault("default_epochs", OLD_DEFAULT_EPOCHS)
    return report


def _row_walks(rows: Any) -> bool:
    """Whether `rows` is what the Scorer writes: {row id: [tokens, steps]}, non-negative integers."""
    return isinstance(rows, dict) and all(
        str(r).isdigit() and isinstance(v, list) and len(v) == 2 and all(type(x) is int and x >= 0 for x in v)
        for r, v in rows.items()
    )


def merge(reports: dict[Path, dict[str, Any]], across_rows: bool = False) -> dict[str, Any]:
    """The reports as one: the first's target, data and baselines, every report's runs and curves. With
    `across_rows`, reports on other rows of the same target merge too (their runs keep their report's rows)."""
    (first, base), *rest = reports.items()
    compared = [s for s in SAME if s not in SAME_ROWS] if across_rows else SAME
    for path, report in rest:
        for what, where in compared:
            if _at(report, where) != _at(base, where):
                raise SystemExit(
                    f"error: {path}: another {what} than {first} ({_at(report, where)!r} against "
                    f"{_at(base, where)!r}): its drafters are not comparable"
                )
        if recipe_flags(report.get("train_args")) != recipe_flags(base.get("train_args")):
            raise SystemExit(
                f"error: {path}: other dflash-train flags than {first} ({report.get('train_args')!r} against "
                f"{base.get('train_args')!r}): its drafters are not comparable"
            )
    seen: dict[str, Path] = {}
    for path, report in reports.items():
        for entry in report["runs"]:
            if entry["run"] in seen:
                raise SystemExit(f"error: run {entry['run']} is in both {seen[entry['run']]} and {path}")
            seen[entry["run"]] = path
    if across_rows:
        return _merge_across_rows(reports, base)
    entries = [e for r in reports.values() for e in r["runs"]]
    runs = [Run.from_report(e) for e in entries]
    return {
        **{k: base[k] for k in KEPT if k != "runs"},
        "data_order": base["data_order"],
        "default_epochs": base["default_epochs"],
        "table": summarize(runs, base["baselines"]),
        "curves": [c for r in reports.values() for c in r.get("curves", [])],
        "runs": entries,
        "train_args": {str(p): r.get("train_args") for p, r in reports.items()},
        "seconds": {},
        "merged_from": [str(p) for p in reports],
    }


def _rows_of(report: dict[str, Any]) -> str:
    return str(_at(report, SAME_ROWS[0][1]))


def _merge_across_rows(reports: dict[Path, dict[str, Any]], base: dict[str, Any]) -> dict[str, Any]:
    """Runs of several rows instances, each entry marked with its instance; a seed on two is refused."""
    instance_of_seed: dict[int, tuple[str, Path]] = {}
    entries = []
    instances: dict[str, dict[str, Any]] = {}
    for path, report in reports.items():
        rows = _rows_of(report)
        if rows not in instances:
            instances[rows] = {"prompt_lookup": report["baselines"]["prompt_lookup"], "reports": []}
        instances[rows]["reports"].append(str(path))
        for entry in report["runs"]:
            seed = Run.from_report(entry).seed
            seen = instance_of_seed.setdefault(seed, (rows, path))
            if seen[0] != rows:
                raise SystemExit(
                    f"error: {path}: seed {seed} also ran on other rows in {seen[1]} ({rows[:12]} against "
                    f"{seen[0][:12]}): its pairs would straddle two rows instances"
                )
            entries.append({**entry, "rows_sha256": rows})
    return {
        **{k: base[k] for k in KEPT if k not in ("runs", "data", "baselines")},
        "data_order": base["data_order"],
        "default_epochs": base["default_epochs"],
        "rows_instances": instances,
        "runs": entries,
        "train_args": {str(p): r.get("train_args") for p, r in reports.items()},
        "merged_from": [str(p) for p in reports],
    }


def print_across_rows(merged: dict[str, Any]) -> None:
    """Each rows instance's runs with their walk against that instance's prompt lookup, then the gap tables."""
    instances = merged["rows_instances"]
    for rows, instance in instances.items():
        lookup = instance["prompt_lookup"]
        print(f"\nrows {rows[:12]}: prompt lookup walks {lookup['tau_walk']:.3f} on {lookup['eval_samples']} "
              f"held-out rows ({', '.join(instance['reports'])})")  # fmt: skip
        for entry in merged["runs"]:
            if entry["rows_sha256"] == rows and "tau_walk" in entry:
                ratio = entry["tau_walk"] / lookup["tau_walk"]
                print(f"  {entry['run']:<32} walk {entry['tau_walk']:.3f} ({ratio:.2f}x)")
    print_gaps(merged)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", type=Path, nargs="+", help="quality.json files (bench_quality.py's --json)")
    p.add_argument("--json", type=Path, help="also write the merged report here")
    p.add_argument(
        "--across-rows",
        action="store_true",
        help="merge reports of a rebuilt target (other rows): each seed's paired gaps, no averaged walks",
    )
    args = p.parse_args(argv)
    reports = {path: read_report(path) for path in args.reports}
    if len(reports) < len(args.reports):
        raise SystemExit("error: a report is named twice")
    merged = merge(reports, args.across_rows)
    weights = str(_at(merged, SAME[0][1]))[:12]
    if args.across_rows:
        print(f"{merged['target_kind']} target, weights {weights}; {len(merged['runs'])} runs from "
              f"{len(reports)} reports on {len(merged['rows_instances'])} rows instances")  # fmt: skip
    else:
        print(f"{merged['target_kind']} target, weights {weights}, rows {str(_at(merged, SAME[1][1]))[:12]}; "
              f"{len(merged['runs'])} runs from {len(reports)} reports")  # fmt: skip
    for path, train_args in merged["train_args"].items():
        print(f"  {path}: extra dflash-train flags {train_args or '(none)'}")
    if args.across_rows:
        print_across_rows(merged)
    else:
        print_table(merged)
    if args.json:
        args.json.write_text(json.dumps(merged, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
