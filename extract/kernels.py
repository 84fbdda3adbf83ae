"""Faster kernels for the target's forward where transformers would fall back to reference PyTorch code.

The hybrid Qwen models (qwen3_next, qwen3_5) run each Gated DeltaNet layer's short causal convolution
through `causal_conv1d_fn`, which transformers resolves at import time: the `causal-conv1d` package when
it is installed, else a depthwise `F.conv1d`. `causal-conv1d` ships no wheels (it compiles against the
local torch), while flash-linear-attention, which the same layers already need for their delta rule,
carries a Triton causal convolution. `use_fla_causal_conv1d` points those modeling modules at it.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

_HOOK_NAME = "causal_conv1d_fn"


def _fla_causal_conv1d(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    **_: Any,
) -> torch.Tensor:
    """transformers' `causal_conv1d_fn` contract ([B, D, T] in and out) on FLA's [B, T, D] kernel."""
    causal_conv1d = _fla_kernel()
    assert causal_conv1d is not None  # use_fla_causal_conv1d installs this only when it imports
    # The modeling code hands a transposed view of a contiguous [B, T, D] projection: this is free.
    out, _state = causal_conv1d(
        hidden_states.transpose(1, 2), weight=weight, bias=bias, activation=activation
    )
    return out.transpose(1, 2)


@functools.cache
def _fla_kernel() -> Callable[..., Any] | None:
    """FLA's causal convolution, or None where this FLA release lacks it (or fails to import)."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except Exception:  # an older FLA layout, or a broken triton: keep transformers' own choice
        return None
    return causal_conv1d


def fla_conv_usable(device: torch.device) -> bool:
    """FLA's Triton convolution can run here, and the `causal-conv1d` package (preferred) is absent."""
    if device.type != "cuda" or importlib.util.find_spec("causal_conv1d") is not None:
        return False
    return _fla_kernel() is not None  # None without fla, or without the triton it imports


def use_fla_causal_conv1d(model: torch.nn.Module, device: torch.device) -> list[str]:
    """Route the short convolutions of `model`'s modeling modules to FLA's kernel when `fla_conv_usable`.

    Returns the modules patched (empty when nothing applied: a dense model, a CPU, or `causal-conv1d`
    installed). The patch is per modeling module, process-wide, like transformers' own resolution.
    """
    if not fla_conv_usable(device):
        return []
    modules = {type(m).__module__ for m in model.modules()}
    patched = []
    for name in sorted(modules):
        module = sys.modules.get(name)
        if module is not None and callable(getattr(module, _HOOK_NAME, None)):
            setattr(module, _HOOK_NAME, _fla_causal_conv1d)
            patched.append(name)
    if patched:
        log.info("short convolutions use flash-linear-attention's Triton kernel (%s)", ", ".join(patched))
    return patched
