"""Byte counts as the dry runs of extraction and training print them (no torch: dry runs stay light)."""

from __future__ import annotations


def size_text(n: float) -> str:
    """Bytes in binary units: '512 B', '1.5 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
