"""`ExtractConfig`: every setting of `dflash-extract`, checked once, up front.

Kept free of heavy imports (no torch, no pyarrow) so `--dry-run` and `--help` start fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dflash.shards.codec_costs import CODEC_COSTS
from dflash.shards.layers import capture_layer_ids, check_layer_ids
from dflash.shards.urls import check_url, default_stage_dir, is_url, local_path

CODECS = tuple(CODEC_COSTS)  # every codec of shards/codecs.py, without importing torch
OVERLONG_POLICIES = ("truncate", "skip")
NONFINITE_POLICIES = ("fail", "skip")
DTYPES = ("bfloat16", "float32", "auto")
GiB = 1 << 30
STAGED_UNITS = 4  # shards the staging directory of a run publishing to object storage holds at most


@dataclass(frozen=True, kw_only=True, slots=True)
class ColumnNames:
    """Names of the dataset columns. `seq_len` is optional in the data: derived from the list offsets when absent."""

    input_ids: str = "input_ids"
    loss_mask: str = "loss_mask"
    seq_len: str = "seq_len"

    def __post_init__(self) -> None:
        names = (self.input_ids, self.loss_mask, self.seq_len)
        if any(not isinstance(n, str) or not n for n in names):
            raise ValueError(f"column names must be non-empty strings, got {names}")
        if len(set(names)) != 3:
            raise ValueError(
                f"input_ids, loss_mask and seq_len columns must differ, got {names}; pass distinct --*-column names"
            )

    def to_dict(self) -> dict[str, str]:
        return {"input_ids": self.input_ids, "loss_mask": self.loss_mask, "seq_len": self.seq_len}


@dataclass(kw_only=True, slots=True)
class ExtractConfig:
    """Settings of one extraction (or dry run). See `dflash-extract --help` for each field."""

    target: Path
    dataset: Path
    out: Path | None = None
    layers: list[int] | Literal["all"] | None = None
    num_draft_layers: int | None = None
    codec: str = "lossless"
    max_len: int = 3072
    overlong: str = "truncate"
    token_budget: int = 16384
    pad_multiple: int = 1
    unit_bytes: int = GiB
    columns: ColumnNames = field(default_factory=ColumnNames)
    dtype: str = "bfloat16"
    device: str = "auto"
    trust_remote_code: bool = False
    compile: bool = True  # CUDA only: torch.compile the target's layer parts (same math, faster)
    force: bool = False
    on_nonfinite: str = "fail"  # a row whose hidden states hold NaN/inf: stop the run, or skip the row
    allow_empty: bool = False  # a dataset with no row to extract makes an (empty) cache instead of an error
    dry_run: bool = False
    json: bool = False
    num_encode_threads: int | None = None
    queue_depth: int = 4
    publish_to: str | None = None  # --out URL (s3://bucket/prefix): `out` is then the local staging directory
    stage_dir: Path | None = None

    def __post_init__(self) -> None:
        self.target = local_path(self.target, "--target")
        self.dataset = local_path(self.dataset, "--dataset")
        if self.out is not None and is_url(str(self.out)) and not str(self.out).startswith("file://"):
            # Object storage: written into a local staging directory, published as it goes (shards.publish).
            self.publish_to = check_url(str(self.out), "--out")
            self.out = Path(self.stage_dir) if self.stage_dir else default_stage_dir(self.publish_to)
        if self.out is not None:
            self.out = local_path(self.out, "--out")
        elif not self.dry_run:
            raise ValueError("out is required (the cache directory to write); pass --out CACHE")
        if self.layers is not None and self.num_draft_layers is not None:
            raise ValueError(
                f"give either layers ({self.layers}) or num_draft_layers ({self.num_draft_layers}), not both"
            )
        if isinstance(self.layers, str):
            if self.layers != "all":
                raise ValueError(f"layers must be a list of layer ids or 'all', got {self.layers!r}")
        elif self.layers is not None:
            self.layers = sorted(set(check_layer_ids(self.layers, what="layers")))  # stored once each
        if self.num_draft_layers is not None and self.num_draft_layers < 1:
            raise ValueError(f"num_draft_layers must be >= 1, got {self.num_draft_layers}")
        _check_choice("codec", self.codec, CODECS)
        _check_choice("overlong", self.overlong, OVERLONG_POLICIES)
        _check_choice("on_nonfinite", self.on_nonfinite, NONFINITE_POLICIES)
        _check_choice("dtype", self.dtype, DTYPES)
        if self.max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {self.max_len}")
        if self.token_budget < 1:
            raise ValueError(f"token_budget must be >= 1 padded tokens per batch, got {self.token_budget}")
        if self.pad_multiple < 1:
            raise ValueError(f"pad_multiple must be >= 1, got {self.pad_multiple}")
        if self.unit_bytes < 1 << 20:
            raise ValueError(f"unit_bytes must be >= 1 MiB (one shard per unit), got {self.unit_bytes}")
        if not isinstance(self.columns, ColumnNames):
            raise ValueError(f"columns must be a ColumnNames, got {type(self.columns).__name__}")
        if not self.device or not (
            self.device in ("auto", "cpu", "cuda") or self.device.startswith(("cuda:", "mps"))
        ):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.num_encode_threads is not None and self.num_encode_threads < 1:
            raise ValueError(f"num_encode_threads must be >= 1, got {self.num_encode_threads}")
        if self.queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {self.queue_depth}")

    def resolved_layers(self, num_hidden_layers: int) -> list[int]:
        """The layers to capture from a `num_hidden_layers`-deep target (`shards.layers.capture_layer_ids`)."""
        return capture_layer_ids(num_hidden_layers, self.layers, self.num_draft_layers)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
