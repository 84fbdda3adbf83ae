"""The compiled training path: the drafter's regions around attention, via torch.compile (and the tools
`loss.py` compiles its epilogue with).

Eager, a Qwen3-8B-shaped step spends a third of its time outside matmuls and attention: RMSNorms in fp32,
RoPE, SwiGLU, residual adds, autocast casts, and passes over the [rows, vocab] logits, each a separate
kernel reading and writing full activations. Compiled, Inductor fuses each run of them into a few kernels.
Attention is left out on purpose: it keeps `mask.py`'s kernel choice and dense fallback.

Public API:
    speed_up(model, mode="auto", *, backend="inductor") -> bool        mode: "auto"/True, "on", "off"/False
        installs compiled `Regions` on a `DFlashDrafter` in place (parameter names, state_dict and DDP are
        unaffected); "auto" compiles on CUDA only. One compiled function serves all layers, and each
        compiles once: its inputs' token axes are marked dynamic before the first call (`mark_token_axes`).
    regions_backend(model) -> str | None       the backend a (possibly DDP-wrapped) drafter was compiled with
    CompiledOrEager(fn, name, backend)         calls torch.compile(fn); on its first failure logs one warning
                                               and runs `fn` eagerly for the rest of the process
    mark_token_axes(args)                      marks the token axis of every tensor argument dynamic
    compile_backward_now()                     context: lower the backward graph while the forward compiles
    COMPILE_CHOICES = ("auto", "on", "off")
Compiled artefacts are cached on disk by Inductor (TORCHINDUCTOR_CACHE_DIR, default a per-user temp dir):
a later run with the same shapes skips code generation, which is most of the time to the first step.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import torch

from .model import EAGER_REGIONS, DFlashDrafter, Regions

log = logging.getLogger(__name__)
COMPILE_CHOICES = ("auto", "on", "off")


def compile_backward_now() -> contextlib.AbstractContextManager[object]:
    """Make torch.compile lower the backward while the forward compiles. By default the backward is lowered
    lazily, at the first backward() of each new (often dynamic-shape) graph, where a lowering error can
    neither be caught nor fall back; forced, it surfaces in the forward call."""
    import torch._functorch.config as config  # not loaded by `import torch`: an attribute access can fail

    if hasattr(config, "force_non_lazy_backward_lowering"):
        return config.patch(force_non_lazy_backward_lowering=True)
    return contextlib.nullcontext()


# The token axis of the compiled functions' tensors by rank: [T], [T, H], [T, heads, D] on axis 0, the
# attention layout [1, heads, T, D] on axis 2. Every other size is the model's and stays static.
_TOKEN_AXIS = {4: 2}


def mark_token_axes(args: tuple[Any, ...]) -> None:
    """Mark each tensor argument's token count dynamic (a tuple's tensors too) before Dynamo sees it.

    Packs differ in their numbers of blocks and context tokens, so left to itself Dynamo compiles the
    first step for its exact shapes and, at the second, compiles everything again with those axes
    dynamic (automatic dynamic): a second full compile cold, a second round of cache loads warm. Marked
    up front, the first compile is the graph the run keeps. `maybe_`: a size Dynamo must specialize (0 or
    1) still may be."""
    for arg in args:
        for t in arg if isinstance(arg, tuple) else (arg,):
            if isinstance(t, torch.Tensor) and t.ndim:
                torch._dynamo.maybe_mark_dynamic(t, _TOKEN_AXIS.get(t.ndim, 0))


class CompiledOrEager:
    """`fn` through torch.compile, falling back to `fn` itself (same math) if compiling or running fails."""

    def __init__(self, fn: Callable[..., Any], name: str, backend: str = "inductor"):
        self.eager = fn
        self.name = name
        self.backend = backend
        self.compiled = torch.compile(fn, backend=backend, fullgraph=True)
        self.failure: str | None = None

    def __call__(self, *args: Any) -> Any:
        if self.failure is None:
            try:
                mark_token_axes(args)
                with compile_backward_now():
                    return self.compiled(*args)
            except Exception as exc:  # Dynamo, Inductor and Triton raise many classes, often wrapped
                cause = _root_cause(exc)
                if isinstance(cause, torch.OutOfMemoryError):
                    raise cause from exc  # eager needs more memory, not less
                detail = (str(cause).strip().splitlines() or [""])[0][:300]
                self.failure = f"{type(cause).__name__}: {detail}"
                log.warning("compiling %s failed (%s); it runs eagerly from now on", self.name, self.failure)
        return self.eager(*args)


def _root_cause(exc: BaseException) -> BaseException:
    """The error under Dynamo's wrappers (BackendCompilerFailed keeps it in `inner_exception`)."""
    while True:
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        if inner is None:
            return exc
        exc = inner


def speed_up(model: DFlashDrafter, mode: bool | str = "auto", *, backend: str = "inductor") -> bool:
    """Compile the drafter's regions in place when `mode` asks for it; returns whether it did.
    `mode`: "auto" (or True, `TrainConfig.compile`'s default) compiles on CUDA, "on" anywhere, "off" (False)
    never."""
    mode = {True: "auto", False: "off"}.get(mode, mode) if isinstance(mode, bool) else mode
    if mode not in COMPILE_CHOICES:
        raise ValueError(f"compile mode must be one of {', '.join(COMPILE_CHOICES)}, got {mode!r}")
    device = next(model.parameters()).device
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return False
    compiled = {
        f.name: CompiledOrEager(getattr(EAGER_REGIONS, f.name), f"drafter {f.name}", backend)
        for f in fields(Regions)
        if f.name != "backend"
    }
    model.regions = Regions(**compiled, backend=backend)
    log.info("drafter regions compiled with %s (the first steps take longer)", backend)
    return True


def regions_backend(model: torch.nn.Module) -> str | None:
    """The compile backend of a drafter's regions (None: eager); sees through DDP's `.module`."""
    regions = getattr(getattr(model, "module", model), "regions", None)
    return regions.backend if isinstance(regions, Regions) else None
