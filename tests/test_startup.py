"""The start-up pieces of issue 13: the NaN/inf count where a tensor lives (`count_nonfinite`, used on the
frozen weights once they are on the device by `guards.check_frozen_finite`), and the set-up clock."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from dflash.shards import codec_base
from dflash.shards.codecs import count_nonfinite
from dflash.shards.errors import ShardError
from dflash.train import guards
from dflash.train.frozen import FrozenTarget
from dflash.train.startup import PHASES, StartupClock, describe

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


def _poisoned(dtype: torch.dtype, rows: int = 37, cols: int = 29) -> torch.Tensor:
    """Finite extremes (max, min subnormal, -0) beside NaN and both infinities, across chunk boundaries."""
    x = torch.randn(rows, cols).to(dtype)
    info = torch.finfo(dtype)
    flat = x.view(-1)
    flat[0], flat[1], flat[2] = info.max, -info.max, info.smallest_normal / 4
    flat[3], flat[100], flat[101] = -0.0, float("nan"), float("inf")
    flat[-1], flat[517], flat[518] = float("-inf"), float("nan"), float("nan")
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_nonfinite_counts_are_exact_where_the_tensor_lives(
    dtype: torch.dtype, device: str, monkeypatch
) -> None:
    monkeypatch.setattr(codec_base, "_SCAN_CHUNK", 64)  # many chunks and a ragged last one
    monkeypatch.setattr(codec_base, "_DEVICE_SCAN_CHUNK", 64)
    a = _poisoned(dtype)
    assert int((~torch.isfinite(a)).sum()) == 5
    assert [count_nonfinite(t.to(device)) for t in (a, a.t(), torch.ones(3, 5, dtype=dtype), a[:0])] == [
        5,
        5,
        0,
        0,
    ]
    with pytest.raises(ValueError, match=r"unsupported dtype torch\.int32"):
        count_nonfinite(torch.ones(3, dtype=torch.int32))


@pytest.mark.parametrize("device", DEVICES)
def test_frozen_check_names_the_tensor_and_counts_a_tied_table_once(device: str, monkeypatch) -> None:
    cache, source = SimpleNamespace(path="CACHE"), r"^CACHE/target/frozen\.safetensors: "
    embed, head = _poisoned(torch.bfloat16).to(device), torch.zeros(37, 29, dtype=torch.bfloat16).to(device)
    with pytest.raises(ShardError, match=source + "embed_tokens holds 5 NaN/inf values$"):
        guards.check_frozen_finite(cache, FrozenTarget(embed, head, {}))
    head[1, 2] = float("inf")
    with pytest.raises(ShardError, match=source + "lm_head holds 1 NaN/inf values$"):
        guards.check_frozen_finite(cache, FrozenTarget(head.clone().zero_(), head, {}))
    seen: list[torch.Tensor] = []
    monkeypatch.setattr(guards, "count_nonfinite", lambda t: seen.append(t) or 0)
    guards.check_frozen_finite(cache, FrozenTarget(torch.ones(4, 3), torch.ones(4, 3), {}))
    assert len(seen) == 2
    tied = torch.ones(4, 3)
    guards.check_frozen_finite(cache, FrozenTarget(tied, tied, {}))
    assert len(seen) == 3  # one count for the one matrix


def test_startup_clock_phases_never_sum_past_the_total() -> None:
    clock = StartupClock()
    with clock.phase("cache_open"):
        time.sleep(0.002)
    for _ in range(2):  # a phase timed in parts adds up
        t = time.perf_counter()
        time.sleep(0.006)
        clock.add("first_step", time.perf_counter() - t)
    with pytest.raises(KeyError, match="unknown start-up phase 'nap'"):
        clock.add("nap", 1.0)
    record = clock.finish()
    assert list(record) == [*(f"{p}_s" for p in PHASES), "total_s"]
    assert record["first_step_s"] >= 0.012 and record["cache_open_s"] >= 0.002
    assert sum(v for k, v in record.items() if k != "total_s") <= record["total_s"]
    line = describe(record)
    assert line.startswith(f"start-up {record['total_s']:.2f} s to the end of the first step: ")
    assert "first_step 0.0" in line and "process_group" not in line  # phases under 0.01 s left out
