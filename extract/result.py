"""`ExtractResult`: what one extraction process did, as a closing table or the `--json` object."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from dflash.shards.sizes import CacheSize


@dataclass(kw_only=True, slots=True)
class ExtractResult:
    """What one process did (and whether the cache is now complete); `to_dict` is the --json output."""

    cache: str
    complete: bool
    rank: int = 0
    world_size: int = 1
    device: str = "cpu"
    units_total: int = 0
    units_done: int = 0  # by this process in this run
    units_committed: int = 0  # in the cache, all runs and ranks
    rows: int = 0
    rows_skipped: int = 0
    rows_nonfinite: int = 0  # of rows_skipped: NaN/inf hidden states (--on-nonfinite skip), this run
    tokens: int = 0
    bytes_written: int = 0
    raw_bytes: int = 0  # the written states' raw bytes in the stored dtype (`raw_dtype`; sizes.CacheSize)
    raw_dtype: str = "bfloat16"
    already_complete: bool = False  # the cache was complete before this run: it had nothing to do
    seconds: float = 0.0  # the whole call: setup, extraction, finalization
    extract_seconds: float = 0.0  # the staged extraction only (first batch to last commit)
    cpu_seconds: float = 0.0  # process CPU time during the staged extraction
    gpu_compute_s: float = 0.0
    gpu_wait_fraction: float = 0.0
    encode_cpu_s: float = 0.0
    stages: dict[str, dict[str, float]] = field(default_factory=dict)
    # (tokens, GPU ms, host ms) per batch, for benchmarks; not in --json (a real run has thousands)
    batch_times: list[tuple[int, float, float]] = field(default_factory=list, repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.extract_seconds if self.extract_seconds else 0.0

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_written / self.tokens if self.tokens else 0.0

    @property
    def size(self) -> CacheSize:
        """What this run wrote, by the definition every dflash size uses."""
        return CacheSize(stored_bytes=self.bytes_written, raw_bytes=self.raw_bytes, dtype=self.raw_dtype)

    @property
    def ratio(self) -> float:
        return self.size.ratio or 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["batch_times"]
        d.update(
            tokens_per_s=self.tokens_per_s,
            bytes_per_token=self.bytes_per_token,
            ratio=self.ratio,
            cpu_cores_used=self.cpu_seconds / self.extract_seconds if self.extract_seconds else 0.0,
        )
        return d


def format_summary(r: ExtractResult) -> str:
    """The closing table: totals, then each stage's busy and waiting seconds; one line when a complete
    cache had nothing left to do."""
    if r.already_complete and not r.units_done:
        return (
            f"cache {r.cache}: complete, nothing to do ({r.units_committed} of {r.units_total} units "
            f"committed before); check it with `dflash-shards verify {r.cache}`"
        )
    forward = "GPU (forward)" if r.device.startswith("cuda") else f"forward ({r.device})"
    lines = [
        f"cache {r.cache}: {'complete' if r.complete else 'INCOMPLETE'}, units {r.units_committed}/{r.units_total} "
        f"committed ({r.units_done} by this process, rank {r.rank}/{r.world_size} on {r.device})",
        f"rows {r.rows:,}  tokens {r.tokens:,}  in {r.extract_seconds:,.1f} s = {r.tokens_per_s:,.0f} tokens/s "
        ""
        f"({r.seconds:,.1f} s with setup); "
        f"written {r.size.text()}, {r.bytes_per_token:,.0f} B/token; "
        f"CPU cores used {r.cpu_seconds / max(r.extract_seconds, 1e-9):.1f}",
        f"{forward} wait fraction {r.gpu_wait_fraction:.1%}  (compute {r.gpu_compute_s:,.1f} s)",
        *(
            [
                f"skipped {r.rows_nonfinite:,} rows with NaN/inf hidden states (listed in the manifest's skipped rows)"
            ]
            if r.rows_nonfinite
            else []
        ),
        f"{'stage':<10}{'busy s':>10}{'wait in s':>11}{'wait out s':>12}{'waiting':>9}",
    ]
    for name, s in r.stages.items():
        lines.append(
            f"{name:<10}{s['busy_s']:>10.2f}{s['wait_in_s']:>11.2f}{s['wait_out_s']:>12.2f}{s['wait_fraction']:>9.1%}"
        )
    return "\n".join(lines)
