"""What the user sees: a progress bar, `RUN/metrics.jsonl`, TensorBoard events and PNG plots.

Only rank 0 writes. One JSON object per logged or evaluated step; on `--resume` the records past the
checkpoint are dropped (they belong to the interrupted trajectory) and TensorBoard purges them too. The
first record of each launch also holds `startup`: its set-up seconds by phase (`startup.py`).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.shards.atomic import atomic_write, atomic_write_bytes
from dflash.shards.errors import ShardError
from dflash.shards.progress import format_eta, progress_bar
from dflash.shards.safe_io import load_json

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PLOTS_DIR = "plots"
TB_DIR = "tensorboard"


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of `RUN/metrics.jsonl` (a torn last line from a crash is ignored)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    records, dropped = [], []
    lines = [line for line in path.read_bytes().splitlines() if line.strip()]
    for i, line in enumerate(lines):
        try:
            record = load_json(line, str(path))  # bad UTF-8 too is a ShardError here
        except ShardError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("step", 0), int):
            records.append(record)
        else:
            dropped.append(i + 1)
    if dropped and dropped != [len(lines)]:  # more than a torn last line
        log.warning(
            "%s: ignored %d line(s) that are not JSON records, first line %d (damaged file?)",
            path,
            len(dropped),
            dropped[0],
        )
    return records


@dataclass(slots=True)
class LogWindow:
    """Sums between two log steps (the loss sum may stay a device tensor until then); `record` reduces
    them over ranks with one call of `reduce_sum`, the log step's one collective."""

    loss_sum: Any = 0.0
    weight_sum: float = 0.0
    tokens: float = 0.0
    wait: float = 0.0
    start: float = field(default_factory=time.perf_counter)

    def add(self, loss_sum: Any, weight_sum: float, tokens: int, wait: float) -> None:
        self.loss_sum += loss_sum
        self.weight_sum += weight_sum
        self.tokens += tokens
        self.wait += wait

    def record(
        self, reduce_sum: Callable[[list[float]], list[float]], world_size: int, skipped: int
    ) -> dict[str, Any]:
        elapsed = time.perf_counter() - self.start
        loss, weight, tokens, wait, skipped_all = reduce_sum(
            [float(self.loss_sum), self.weight_sum, self.tokens, self.wait, float(skipped)]
        )
        return {
            "loss": loss / max(weight, 1e-12),
            "tokens_per_s": tokens / max(elapsed, 1e-9),
            "data_wait_frac": min(1.0, wait / max(elapsed * world_size, 1e-9)),
            "skipped_samples": int(skipped_all),
        }


class MetricsLogger:
    """Rank-0 sink for training records; a disabled logger (other ranks) ignores every call."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        enabled: bool,
        start_step: int,
        total_steps: int,
        tensorboard: bool = True,
        plots: bool = True,
        progress: bool = True,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.plots = plots and enabled
        self.history: list[dict[str, Any]] = []
        self._tb = None
        self._bar = None
        self._file = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.history = [r for r in read_metrics(self.run_dir) if r.get("step", 0) <= start_step]
        self._rewrite(self.history)
        self._file = open(self.run_dir / METRICS_FILE, "a")  # noqa: SIM115 (kept open for the run)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(
                str(self.run_dir / TB_DIR), purge_step=start_step + 1 if start_step else None
            )
        if progress:  # a bar on a terminal, a line every few seconds in a log file
            self._bar = progress_bar("train", total_steps, "step", initial=start_step)

    def _rewrite(self, records: list[dict[str, Any]]) -> None:
        atomic_write_bytes(
            self.run_dir / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in records).encode()
        )

    def log(self, record: Mapping[str, Any]) -> None:
        """Append one record (must hold `step`); scalars also go to TensorBoard."""
        if not self.enabled:
            return
        record = dict(record)
        self.history.append(record)
        assert self._file is not None
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, record["step"])
                elif key == "acceptance_per_position" and isinstance(value, list):
                    for k, v in enumerate(value, start=1):
                        self._tb.add_scalar(f"acceptance/pos_{k:02d}", v, record["step"])

    def progress(self, step: int, fields: Mapping[str, Any]) -> None:
        """Move the bar to `step` and show the latest numbers."""
        if self._bar is None:
            return
        self._bar.update(step - self._bar.n)
        self._bar.set_postfix(fields, refresh=False)

    def show_step(
        self,
        step: int,
        last_step: int,
        record: Mapping[str, Any],
        epoch: int,
        tau: float | None,
        since: float,
    ) -> None:
        """The bar's numbers: epoch, the latest loss, tau, throughput, data wait and the time left (at the
        rate of steps since `since`, a `time.perf_counter()` reading)."""
        rate = step / max(time.perf_counter() - since, 1e-9)
        self.progress(
            step,
            {
                "ep": epoch,
                "loss": f"{record.get('loss', float('nan')):.3f}",
                "tau": f"{tau if tau is not None else float('nan'):.2f}",
                "tok/s": f"{record.get('tokens_per_s', 0):.0f}",
                "wait": f"{100 * record.get('data_wait_frac', 0):.0f}%",
                "eta": format_eta((last_step - step) / max(rate, 1e-9)),
            },
        )

    def write(self, message: str) -> None:
        """A line above the bar (or to the log when there is none)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            log.info(message)

    def refresh_plots(self) -> None:
        """Redraw `RUN/plots/{loss,tau,acceptance}.png` from the history (called after each evaluation)."""
        if not self.plots or not self.history:
            return
        try:
            write_plots(self.history, self.run_dir / PLOTS_DIR)
        except Exception as exc:  # a plot must never kill a run
            log.warning("could not refresh plots: %s", exc)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# The lines of tau.png: the drafter's two taus, and prompt lookup walked over the same rows (the baseline a
# drafter must beat; README "Drafter quality").
TAU_LINES = {
    "tau": "tau (sampled anchors)",
    "tau_walk": "tau (decode walk)",
    "tau_walk_lookup": "prompt lookup (decode walk)",
}


def tau_plot_series(history: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """label -> (steps, values) of each `TAU_LINES` metric the history holds."""
    lines = {}
    for key, label in TAU_LINES.items():
        pairs = [(r["step"], r[key]) for r in history if isinstance(r.get(key), (int, float))]
        if pairs:
            lines[label] = ([p[0] for p in pairs], [p[1] for p in pairs])
    return lines


def write_plots(history: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Loss and tau over steps, and the latest per-position acceptance, as PNGs (written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig: Any, name: str) -> None:
        path = atomic_write(
            out_dir / name, lambda tmp: fig.savefig(tmp, format="png", dpi=90, bbox_inches="tight")
        )
        plt.close(fig)
        written.append(path)

    def series(key: str) -> tuple[list[int], list[float]]:
        pairs = [(r["step"], r[key]) for r in history if isinstance(r.get(key), (int, float))]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("loss", "train loss"), ("eval_loss", "eval loss")):
        xs, ys = series(key)
        if xs:
            ax.plot(xs, ys, label=label, marker="." if key == "eval_loss" else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, "loss.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (xs, ys) in tau_plot_series(history).items():
        dashed = label.startswith("prompt lookup")
        ax.plot(xs, ys, label=label, marker=None if dashed else ".", linestyle="--" if dashed else "-")
    ax.set_xlabel("step")
    ax.set_ylabel("acceptance length tau")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, "tau.png")

    latest = next((r for r in reversed(history) if isinstance(r.get("acceptance_per_position"), list)), None)
    fig, ax = plt.subplots(figsize=(7, 4))
    if latest is not None:
        values = latest["acceptance_per_position"]
        ax.bar(range(1, len(values) + 1), values)
        ax.set_title(f"step {latest['step']}")
    ax.set_xlabel("block position k")
    ax.set_ylabel("P(first k drafts accepted)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3, axis="y")
    save(fig, "acceptance.png")
    return written
