"""Go on from a finished quality-benchmark run the way `dflash-train` tells a user to: the run's own command
line with `--resume` and the new length, in a copy of the run, so the finished run and its export stay:

    python bench/quality_resume.py W/hybrid/runs base-fp8-f1-s0 r9-fp8-f1-s0 --epochs 9

The copy's metrics.jsonl keeps the finished run's evaluations and adds the resumed ones; the copy is
exported to NEW/final like any run of the benchmark. Its logs: RUNS/NEW.log and RUNS/NEW-export.log."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.quality_phases import command_file, train_and_export


def resume_flags(flags: list[str], out: Path, extra: list[str]) -> list[str]:
    """`flags` with `--out` pointed at `out`, then `--resume` and `extra` (later flags win)."""
    i = flags.index("--out")
    return [*flags[: i + 1], str(out), *flags[i + 2 :], "--resume", *extra]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", type=Path, help="the benchmark's runs folder (W/T/runs)")
    p.add_argument("run", help="the finished run to go on from")
    p.add_argument("new", help="the copy's name")
    args, extra = p.parse_known_args(argv)
    source, copy = args.runs / args.run, args.runs / args.new
    cmd_file = command_file(args.runs, args.run)
    if not (source / "final" / "config.json").is_file() or not cmd_file.is_file():
        raise SystemExit(
            f"error: {source}: not a finished benchmark run (no final/ export or {cmd_file.name})"
        )
    if copy.exists():
        raise SystemExit(f"error: {copy} exists")
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("final"))
    flags = resume_flags(json.loads(cmd_file.read_text()), copy, extra)
    try:
        train_and_export(flags, copy, args.new)
    except RuntimeError as exc:  # names the failed command and the end of its log
        raise SystemExit(f"error: {exc}") from None
    print(f"resumed {args.run} as {args.new}: {copy}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
