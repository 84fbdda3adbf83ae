"""The fp8 quantizer as first written (before issue 14): the oracle its faster paths must match bit for bit
(tests/test_fp8_quantize.py) and the baseline of the GPU quantize table (bench/bench_codecs.py)."""

from __future__ import annotations

import torch


def reference_quantize_fp8(x: torch.Tensor, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8 as first written (before issue 14), with its per-device chunk sizes 2^24 / 2^18."""
    s, h = x.shape
    q = torch.empty((s, h), dtype=torch.uint8, device=x.device)
    amax = torch.maximum(x.amax(dim=1).float(), -x.amin(dim=1).float())
    # a tensor divisor: CUDA multiplies by the reciprocal of a Python number (the spec divides)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, 448.0), torch.ones_like(amax))
    chunk = chunk or (1 << 24 if x.is_cuda else 1 << 18)
    rows = max(1, chunk // h)
    for r0 in range(0, s, rows):
        part = torch.div(x[r0 : r0 + rows].float(), scale[r0 : r0 + rows, None]).clamp_(-448.0, 448.0)
        q[r0 : r0 + rows] = part.to(torch.float8_e4m3fn).view(torch.uint8)
    return q, scale
