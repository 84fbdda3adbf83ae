"""The quality benchmark's sizes (target, data and drafter recipe per size) and its plan of runs: every
recipe variant x codec x seed, and the data-size curve (`bench/bench_quality.py` runs them). A size's target
is the code one; `--target` replaces its `kind` (prose, hybrid) and keeps the shape, vocabulary and budget, so
every target of a size trains the same steps on the same number of parameters (the hybrid within 2%)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash.train.config import DEFAULT_EARLY_STOP, DraftSpec, LoaderConfig, OptimConfig
from dflash.train.resume_checks import BEFORE_DEFAULTS
from dflash.train.schedule import DEFAULT_EPOCHS_RULE

from bench.quality_data import DataSpec
from bench.quality_target import TargetSpec

# the epoch order of a run or report that names none: it predates spans (`dflash-train --data-order`)
OLD_ORDER = BEFORE_DEFAULTS["data_order"]
# dflash-train's length without --epochs, as a report records it (`default_epochs`): runs on its defaults
# trained this long. A report that names none predates `schedule.default_epochs`: 6 epochs on any dataset.
OLD_DEFAULT_EPOCHS = "6"
# since --early-stop (on by default) the length also ends where the held-out walk falls below its best
NOW_DEFAULT_EPOCHS = f"{DEFAULT_EPOCHS_RULE}; --early-stop {DEFAULT_EARLY_STOP:g}"


@dataclass(frozen=True, kw_only=True, slots=True)
class DrafterRecipe:
    """The `dflash-train` flags every run of a size shares (`--train-args` appends more)."""

    layers: int
    block_size: int
    num_anchors: int
    token_budget: int
    steps: int | None  # None: dflash-train's epochs set the length (`trainer_defaults` only)
    lr: float
    eval_points: int = 4  # evaluations along the full-data run: the tau-vs-steps curve
    target_layer_ids: str | None = None  # None: DFlash's default rule for `layers` drafter layers
    gamma: float | None = None  # the loss decay over block slots; None: the paper's for the block size
    extra: tuple[str, ...] = ()
    # Train with dflash-train's own defaults, as a new user would (`--recipe defaults`): no recipe flag but
    # `--max-steps` when `steps` is set. The fields above then only describe the evaluation, and equal them.
    trainer_defaults: bool = False

    def flags(self) -> list[str]:
        if self.trainer_defaults:
            return ["--max-steps", str(self.steps)] if self.steps else []
        return [
            "--num-draft-layers", str(self.layers),
            "--block-size", str(self.block_size),
            "--num-anchors", str(self.num_anchors),
            "--token-budget", str(self.token_budget),
            "--max-length", str(self.token_budget),
            "--lr", str(self.lr),
            "--max-steps", str(self.steps),
            "--epochs", "1000",
            "--early-stop", "0",  # every recorded run of a fixed-step recipe trained all its steps
            *(["--target-layer-ids", self.target_layer_ids] if self.target_layer_ids else []),
            # a fixed decay, as every recorded run of this benchmark (dflash-train's default is `reach`)
            *(["--slot-weights", "decay", "--gamma", str(self.gamma)] if self.gamma is not None else []),
            *self.extra,
        ]  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class Size:
    target: TargetSpec
    data: DataSpec
    drafter: DrafterRecipe
    seeds: int = 1
    fractions: tuple[float, ...] = (0.25, 0.5, 1.0)  # of the training rows, for tau vs data size
    parallel_runs: int = 1
    codecs: tuple[str, ...] = ("lossless", "fp8", "q4")
    extract_token_budget: int = 16384  # `dflash-extract --token-budget`: padded tokens per forward


SIZES: dict[str, Size] = {
    # Every phase in seconds on a CPU: checks the benchmark, not the drafter.
    "ci": Size(
        target=TargetSpec(
            vocab=384,
            hidden=48,
            layers=4,
            heads=4,
            kv_heads=2,
            intermediate=96,
            seq_len=64,
            batch=8,
            steps=40,
            lr=3e-3,
            corpus_mb=1.0,
            bpe_mb=0.3,
        ),
        data=DataSpec(train_rows=48, eval_rows=12, prompt_min=24, prompt_max=40, new_tokens=24, gen_batch=64),
        drafter=DrafterRecipe(
            layers=1,
            block_size=8,
            num_anchors=16,
            token_budget=256,
            steps=12,
            lr=3e-3,
            gamma=2.0,
            eval_points=2,
        ),
        fractions=(0.5, 1.0),
    ),
    # The development box (one effective core): ~15 min, a small but real signal.
    "cpu": Size(
        target=TargetSpec(
            vocab=1024,
            hidden=128,
            layers=6,
            heads=4,
            kv_heads=2,
            intermediate=384,
            seq_len=128,
            batch=16,
            steps=1500,
            lr=3e-3,
            corpus_mb=12,
            bpe_mb=3,
        ),
        data=DataSpec(
            train_rows=3000, eval_rows=100, prompt_min=64, prompt_max=128, new_tokens=96, gen_batch=256
        ),
        # lr 1e-3 walked 2.01 against 3e-3's 1.82 at 1500 steps (one seed); the loss decay gamma 1 walked 2.16
        # against 2.04 for gamma 2 and 1.80 for the paper's 4 (two seeds each, BENCHMARKS.md).
        drafter=DrafterRecipe(
            layers=2, block_size=8, num_anchors=64, token_budget=1024, steps=1500, lr=1e-3, gamma=1.0
        ),
        fractions=(0.25, 1.0),
    ),
    # One H200 inside one 10-minute call.
    "quick": Size(
        target=TargetSpec(
            vocab=4096,
            hidden=384,
            layers=8,
            heads=6,
            kv_heads=2,
            intermediate=1152,
            seq_len=512,
            batch=64,
            steps=2500,
            lr=2e-3,
            corpus_mb=120,
            bpe_mb=16,
        ),
        data=DataSpec(
            train_rows=16384, eval_rows=256, prompt_min=64, prompt_max=192, new_tokens=192, gen_batch=1024
        ),
        # Every target layer feeds the drafter: on this shallow target, 8 features beat DFlash's default 3
        # ([1, 3, 5]) and deeper-only ones ([3, 5, 7]) in a side-by-side sweep at lr 2e-3 (BENCHMARKS.md). lr
        # between 6e-4 and 3e-3 moved tau less than seeds did on the GPU; steps moved it most (BENCHMARKS.md).
        drafter=DrafterRecipe(
            # `dflash-train`'s default depth, chosen by the worst target: the hybrid walked 1.33x prompt lookup
            # with 5 layers and 1.23x with 3 at 3000 steps (two and three seeds), 1.47x with 5 at the full size's
            # 6000 (three seeds), and a deeper drafter walked further on every target tried at the `cpu` size.
            # Records before 2026-12-03's fifth session trained 3 (BENCHMARKS.md says which). Alone, 5 layers
            # train ~1.5x slower than 3 at this size; side by side with a 3-layer run (as runs share the GPU
            # here) 3000 steps took 386 s against its 410 s.
            layers=5,
            block_size=16,
            num_anchors=512,
            token_budget=8192,
            # ~2.3 epochs of the 16k rows (~650 packs each), what fits one 10-minute call after building the
            # target (140 s), the data (61 s) and the caches: one epoch (500 steps) walked 0.51x prompt lookup,
            # 1500 steps of a 3000-step schedule 1.28x; 4500 steps (the full size) walk >1.4x (BENCHMARKS.md).
            steps=1500,
            lr=1e-3,
            eval_points=2,
            target_layer_ids="0,1,2,3,4,5,6,7",
            # The paper's gamma (7 for B = 16) spends most of the loss on slots this budget's drafter rarely
            # reaches. On the `cpu` size gamma 1 / 2 walked +20% / +13% over the paper's at 1500 steps. Its
            # drafter accepts less per slot than this one (tau 2.3 against 4.8), so a larger gamma than the
            # `cpu` size's best is taken here; the paper's gamma walked 3.32 at 3000 steps (BENCHMARKS.md).
            gamma=2.0,
        ),
        fractions=(1.0,),  # the data-size curve is the full size's: three more runs do not fit in 10 minutes
        # q4's run is the full size's: a third run side by side does not fit in 10 minutes either. fp8 first:
        # its run draws the tau-vs-steps curve (one more evaluation) since its cache is extracted sooner and
        # costs the loader less, leaving the lossless run, the call's longest, one evaluation.
        codecs=("fp8", "lossless"),
        parallel_runs=8,
        # A 16k-token batch of this 15M-parameter target is a few ms of GPU math but ~200 kernel launches,
        # and each launch hands the GIL to the encode threads: extraction took 71-152 s (BENCHMARKS.md).
        extract_token_budget=131072,
    ),
}
# 6000 steps (~9.2 epochs): on one target instance, three seeds each, a 4500-step schedule ended at 1.49x
# prompt lookup and a 6000-step one at 1.54x (every seed above 1.5x), while `--slot-weights reach` at 4500
# steps walked 1.48x (BENCHMARKS.md); several calls of one H200 (three 5-layer seeds side by side trained in
# 981-987 s on the hybrid target; six 3-layer 4500-step runs took 950 s). The first codec's first seed
# evaluates every 1500 steps.
SIZES["full"] = replace(
    SIZES["quick"],
    seeds=3,
    fractions=(0.25, 0.5, 1.0),
    codecs=("lossless", "fp8", "q4"),
    drafter=replace(SIZES["quick"].drafter, steps=6000, eval_points=4),
)


# Evaluations along a `trainer_defaults` run, whose length its epochs decide: every this many steps.
DEFAULTS_CURVE_EVERY = 1000
# Checkpoints of such a run: a run cut off by a device call's limit goes on from its last one when the same
# command runs again on the same machine (~3,900 steps at the full size, ~10 steps/s: at most ~50 s lost).
DEFAULTS_SAVE_EVERY = 500
CHECKPOINTS_PER_RUN = 8  # of a run whose steps its size sets


def with_trainer_defaults(size: Size) -> Size:
    """`size` with its drafters trained on dflash-train's defaults (the recipe every target is measured on
    for issue 29's "one default recipe"; at the full size and 6 epochs, the default then, code walked 1.71x
    prompt lookup over three seeds, prose 1.45x over two, as far as the size's own recipe, and the hybrid 1.35x
    over three; at 10, the default on these datasets since 2026-12-07, 1.79x / 1.36x / 1.51x, BENCHMARKS.md).
    Refused where the defaults' block size, anchors or pack budget differ from the size's: the evaluation is
    built from those."""
    drafter, loader, recipe = DraftSpec(), LoaderConfig(), size.drafter
    for name, ours, theirs in (
        ("block_size", recipe.block_size, drafter.block_size),
        ("num_anchors", recipe.num_anchors, drafter.num_anchors),
        ("token_budget", recipe.token_budget, loader.token_budget),
    ):
        if ours != theirs:
            raise ValueError(f"--recipe defaults: this size's {name} is {ours}, dflash-train's {theirs}")
    defaults = replace(
        recipe, layers=drafter.num_draft_layers, steps=None, lr=OptimConfig().lr, target_layer_ids=None,
        gamma=None, extra=(), trainer_defaults=True,
    )  # fmt: skip
    return replace(size, drafter=defaults)


@dataclass(kw_only=True, slots=True)
class Run:
    """One `dflash-train` run: recipe variant x codec x training-row fraction x seed."""

    variant: str
    flags: tuple[str, ...]  # the variant's dflash-train flags, after the size's recipe
    codec: str
    fraction: float
    seed: int
    dir: Path
    curve: bool  # the run that evaluates along the way (full data, first seed)
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.variant}-{self.codec}-f{self.fraction:g}-s{self.seed}"

    @classmethod
    def from_report(cls, entry: dict[str, Any]) -> Run:
        """A report's run entry (`{"run": NAME, "flags": [...], **result}`) back as the run it was: `name` read
        from the right (a variant may hold dashes; codecs and the fraction and seed parts do not)."""
        variant, codec, fraction, seed = entry["run"].rsplit("-", 3)
        result = {k: v for k, v in entry.items() if k not in ("run", "flags")}
        return cls(
            variant=variant, flags=tuple(entry.get("flags", ())), codec=codec, fraction=float(fraction[1:]),
            seed=int(seed[1:]), dir=Path("."), curve="curve" in result, result=result,
        )  # fmt: skip


def parse_variants(text: str) -> dict[str, tuple[str, ...]]:
    """`"base=;lr=--lr 2e-3"` -> {"base": (), "lr": ("--lr", "2e-3")}: recipe variants trained side by side."""
    variants: dict[str, tuple[str, ...]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, flags = part.partition("=")
        if not name.strip() or "/" in name:
            raise ValueError(f"--variants: bad variant name in {part!r}")
        variants[name.strip()] = tuple(flags.split())
    return variants or {"base": ()}


def plan_runs(
    root: Path,
    size: Size,
    codecs: list[str],
    variants: dict[str, tuple[str, ...]],
    first_seed: int = 0,
    every_curve: bool = False,
) -> list[Run]:
    """Every variant x codec x seed (`size.seeds` of them from `first_seed`) on all training rows; the
    data-size curve for the first variant, codec and seed. Each variant's first-seed, all-rows run of the
    first codec also evaluates along the way (tau vs steps); the others evaluate at their end only, or, with
    `every_curve`, every all-rows run evaluates along the way (a device job cut short keeps its pairs)."""
    runs = []
    for v, flags in variants.items():
        for s in range(first_seed, first_seed + size.seeds):
            for c in codecs:
                for f in size.fractions:
                    if f != 1.0 and (s, c, v) != (first_seed, codecs[0], next(iter(variants))):
                        continue
                    run = Run(
                        variant=v,
                        flags=flags,
                        codec=c,
                        fraction=f,
                        seed=s,
                        dir=root,
                        curve=f == 1.0 and (every_curve or (s == first_seed and c == codecs[0])),
                    )
                    run.dir = root / run.name
                    runs.append(run)
    return runs


def starts_in_time(left: float, took: list[float]) -> bool:
    """Whether another run may start with `left` seconds before `--deadline`: always before any run has ended
    (nothing to go by), then only when the longest run so far would end in time. A device call kills what is
    still running at its limit: a run cut off goes on from its last checkpoint only if the next call finds the
    same machine (`quality_phases.phase_run`), and on a fresh one it has cost its device time for nothing."""
    return not took or max(took) <= left
