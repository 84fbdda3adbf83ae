"""Helpers shared by the quality benchmark's tests."""

from __future__ import annotations

from pathlib import Path


def ci_argv(work: Path, *flags: str) -> list[str]:
    """bench_quality's command line at the ci size on this CPU, in `work`."""
    return ["--size", "ci", "--device", "cpu", "--work", str(work), *flags]
