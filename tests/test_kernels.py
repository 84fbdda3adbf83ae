"""extract.kernels: FLA's causal convolution replaces transformers' torch fallback only where it can run,
and gives the same layer outputs."""

from __future__ import annotations

import sys

import pytest
import torch
from dflash.extract.kernels import fla_conv_usable, use_fla_causal_conv1d
from dflash.extract.target import load_target

from tests.common.targets import make_target

MODELING = "transformers.models.qwen3_5.modeling_qwen3_5"


def test_cpu_keeps_transformers_convolution(tmp_path) -> None:
    target = load_target(make_target(tmp_path, "qwen3_5_text"), [1, 2], device="cpu")
    before = sys.modules[MODELING].causal_conv1d_fn
    assert not fla_conv_usable(torch.device("cpu"))
    assert use_fla_causal_conv1d(target.model, torch.device("cpu")) == []
    assert sys.modules[MODELING].causal_conv1d_fn is before


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_convolution_matches_torch_fallback_on_gpu(tmp_path) -> None:
    device = torch.device("cuda")
    if not fla_conv_usable(device):
        pytest.skip("flash-linear-attention + triton not installed, or causal-conv1d is")
    target = load_target(
        make_target(tmp_path, "qwen3_5_text"), [0, 1, 2, 3], device=device, dtype=torch.float32
    )
    module = sys.modules[MODELING]
    original = module.causal_conv1d_fn
    torch.manual_seed(0)
    ids = torch.randint(3, 256, (3, 97), device=device)
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # else cuDNN's fp32 conv1d (the reference) rounds to TF32
    try:
        reference = [t.clone() for t in target.capture(ids, None)]
        assert use_fla_causal_conv1d(target.model, device) == [MODELING]
        assert module.causal_conv1d_fn is not original
        patched = target.capture(ids, None)
    finally:
        module.causal_conv1d_fn = original
        torch.backends.cudnn.allow_tf32 = tf32
    # Both runs share FLA's delta-rule kernel, whose fp32 dots round to TF32: the last-bit differences of
    # the two convolutions come out of it at ~1e-4 (seen: 1.4e-4). A wrong kernel is off by O(1).
    for ref, out in zip(reference, patched, strict=True):
        torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)
