"""What each codec costs, measured: stored size, reconstruction error and the drafter's acceptance (tau).

Pure data (no torch) for the size estimates of `dflash-extract --dry-run` / `dflash-shards plan` and the
codec table they print, so users choose a codec knowingly.

- `ratio`, `rel_error`: bench/bench_codecs.py on LLM-like bf16 states (5 layers x [4096, 4096]): raw bf16
  bytes / stored feature bytes, and ||decoded - x|| / ||x|| over typical channels (the 1% largest
  channels left out: they would hide the error of all the others).
- `tau_delta`, `tau_spread`, `tau_seeds`: bench/bench_quality.py on the GPU box (a trained LM as target):
  the drafter's decode-walk tau from this codec's cache relative to the lossless cache's, same seed, averaged
  over `tau_seeds` seeds (e.g. -0.012 = 1.2% lower), and the range of those per-seed differences. None until
  measured; the tables then say "not measured".

fp8 and q4, the table's figures (2026-12-05, one H100, `bench_quality.py --size full --recipe defaults
--score-on lossless`, `dflash-train`'s defaults, every codec's runs of a seed on the same batches (spans), all
scored on lossless features, as serving hands the drafter exact states; bench/reports/code-full-defaults-s*-h100.json
and prose-full-defaults-s2*-h100.json): code seeds 0, 1 and 2 (drafters walking 1.74x, 1.62x and 1.69x prompt
lookup; seed 2 on the same target rebuilt, with other rows) fp8 -0.5% / -0.5% / -0.5%, q4 -1.0% / -1.2% / -2.2%;
prose seed 2 (1.39x) fp8 -0.2%, q4 -0.1%: over the four, fp8 -0.4% (range 0.4 points), q4 -1.1% (range 2.1). The
figures below are earlier ones, each codec's runs on its own batches.
fp8 (2026-12-02, one H200, `bench_quality.py --size full --runs-dir full --codecs
lossless,fp8 --fractions 1 --parallel 6`, the 15M-parameter target, the end (step 4500) of the schedule, a drafter
walking 1.49x prompt lookup, three seeds): per seed +0.47%, +0.36%, -0.37% (walk 4.282/4.261, 4.365/4.349,
4.281/4.297; each run evaluated on its own cache's features; the benchmark's scorer, on the lossless features,
put the means at 4.310 and 4.303). At step 3000 of that schedule on another target instance: -0.9%, -1.7%, -0.4%;
on a third, two seeds: +0.05%, -0.44% (walk 4.081/4.079, 4.070/4.088; the third lossless
seed had not reached step 3000); at step 1500, three seeds: +0.5%, -0.3%, -2.3% (mean -0.7%). Before that (2026-12-01, this CPU box, `bench_quality.py --size cpu --device cpu --codecs
lossless,fp8 --fractions 1 --seeds 3 --variants "g1=--gamma 1 --lr 1e-3"`, 1500 steps, a drafter walking 1.26x
prompt lookup): per seed +0.2%, -0.5%, -0.9% (walk 2.184/2.179, 2.136/2.147, 2.085/2.105). Earlier, on the H200
at 500 steps (`--size full --steps 500`, a drafter still below prompt lookup): -0.21%, +0.09%, -0.11%.
q4 (2026-12-02, one H200, `bench_quality.py --size full --unpack .qart --runs-dir cmp --codecs q4
--fractions 1 --parallel 3`, the 15M-parameter target instance whose prompt lookup walks 2.883, the end (step 6000)
of the schedule, a drafter walking 1.53x prompt lookup, three seeds): walk 4.414 / 4.472 / 4.384 against the
lossless cache's 4.371 / 4.492 / 4.418 on the same instance and seeds (trained the session before, with the same
training code), per seed +1.0%, -0.4%, -0.8%, mean -0.1%. The q4 drafters were scored on q4 features, the
lossless ones on lossless features: serving hands the drafter the exact states, so this figure more likely
overstates q4's cost than understates it.
Before that, q4 (2026-12-01, this CPU box, `bench_quality.py --size cpu --device cpu --codecs lossless,q4 --fractions 1
--variants "a64=--lr 1e-3" --seeds 2`, 1500 steps): walk 1.776 / 1.913 against lossless's 1.746 / 1.850, per
seed +1.7% / +3.4%; two more seeds (2026-12-02, `... --seeds 1 --first-seed 2 --variants "a64=--lr 1e-3 --gamma 4"`,
then `--first-seed 3`: the same recipe on a target retrained on another machine, so each seed is paired with its
own lossless run):
1.734 / 1.635 against 1.764 / 1.734, -1.7% / -5.7%. Mean -0.6% over four seeds, range 9.1 points: at this size
seeds move the comparison more than q4 does, but on the retrained target both seeds were lower.
q6 (the same two runs' seeds 2 and 3, `--codecs lossless,q6,q4`): 1.749 / 1.745 against 1.764 / 1.734, -0.8% /
+0.7%, mean -0.1%.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CodecCost:
    ratio: float  # raw bf16 bytes / stored feature bytes
    # stored per (token, layer) on top of raw / ratio: the float32 token scale of fp8, q6 and q4, which the
    # ratio (measured at hidden 4096) hardly sees but which is 6% of q4's bytes at hidden 128
    scale_bytes: int
    rel_error: float
    tau_delta: float | None = None
    tau_spread: float | None = None
    tau_seeds: int = 0
    tau_bench: str = ""  # which size of bench_quality measured it

    def tau_text(self) -> str:
        if self.rel_error == 0:
            return "0 (exact: the reference)"
        if self.tau_delta is None:
            return "not measured"
        seeds = f"{self.tau_seeds} seed{'s' if self.tau_seeds != 1 else ''}"
        spread = f", per-seed range {100 * self.tau_spread:.1f} points" if self.tau_spread is not None else ""
        where = f", {self.tau_bench}" if self.tau_bench else ""
        return f"{100 * self.tau_delta:+.1f}% ({seeds}{spread}{where})"


# In the order users choose from: exact first, then smaller and lossier.
CODEC_COSTS: dict[str, CodecCost] = {
    "lossless": CodecCost(ratio=1.42, scale_bytes=0, rel_error=0.0),
    "fp8": CodecCost(
        ratio=2.3,
        scale_bytes=4,
        rel_error=0.027,
        tau_delta=-0.004,
        tau_spread=0.004,
        tau_seeds=4,
        tau_bench="15M-parameter code and prose targets, H100",
    ),
    "q6": CodecCost(
        ratio=2.72,
        scale_bytes=4,
        rel_error=0.023,
        tau_delta=-0.001,
        tau_spread=0.015,
        tau_seeds=2,
        tau_bench="1.3M-parameter target, CPU",
    ),
    "q4": CodecCost(
        ratio=4.25,
        scale_bytes=4,
        rel_error=0.10,
        tau_delta=-0.011,
        tau_spread=0.021,
        tau_seeds=4,
        tau_bench="15M-parameter code and prose targets, H100",
    ),
}


def codec_table(estimate: dict[str, int], raw_dtype: str = "bfloat16") -> dict[str, dict]:
    """Per codec: estimated cache bytes, measured relative error and drafter tau cost (shards/codec_costs.py);
    `raw` is the states uncompressed in `raw_dtype`."""
    raw_text = f"exact (not a codec): the {raw_dtype} states uncompressed"
    table = {"raw": {"bytes": estimate["raw"], "rel_error": 0.0, "tau_delta": 0.0, "tau": raw_text}}
    for name, cost in CODEC_COSTS.items():
        table[name] = {
            "bytes": estimate[name],
            "rel_error": cost.rel_error,
            "tau_delta": cost.tau_delta,
            "tau_spread": cost.tau_spread,
            "tau_seeds": cost.tau_seeds,
            "tau": cost.tau_text(),
        }
    return table


def format_codec_table(table: dict[str, dict], chosen: str, size: Callable[[float], str]) -> str:
    """The cache size per codec with what each one costs (`*` marks the chosen codec)."""
    lines = [f"{'codec':<10}{'cache size':>12}{'rel. error':>12}   tau vs lossless (bench_quality)"]
    for name, row in table.items():
        mark = " *" if name == chosen else ""
        lines.append(
            f"{name + mark:<10}{size(row['bytes']):>12}{100 * row['rel_error']:>11.1f}%   {row['tau']}"
        )
    return "\n".join(lines)
