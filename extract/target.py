"""Load a frozen HF causal LM truncated after the last captured layer and capture raw layer outputs.

Only decoder layers 0..max(layer_ids) are built and loaded (`num_hidden_layers` and `layer_types`
truncated in the text config), so a run never pays for layers, the final norm's consumers or the
lm_head logits it does not store. Outputs are taken with forward hooks on the decoder layers: the
last entry of HF `output_hidden_states` is the final-norm output, not a layer output, so hooks are
the only exact source for every layer id.

Batches are right-padded and run WITHOUT an attention mask: every layer is causal (attention, the
Gated DeltaNet scan and its short convolution alike), so a real token never sees the padding after it
and its outputs are those of the row alone; padding positions are computed and never stored. Without a
mask SDPA takes its causal flash kernel and transformers builds no [B, 1, S, S] mask: on an H200 that
was 7% faster for a Qwen3-8B shape and 25% for a Qwen3.5-27B one (BENCHMARKS.md). Left padding or
packing several sequences in one row would not be exact (the DeltaNet state leaks across them).

`CapturingTarget.speed_up` swaps in faster kernels on CUDA: FLA's Triton short convolution for hybrid
models (`extract.kernels`) and, optionally, `torch.compile` of each layer's hook-free parts. A compiled
forward that fails falls back to eager for the rest of the run, with one warning, never losing a batch.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from dflash.shards.layers import check_layer_ids
from dflash.shards.target_config import read_target_config

from .kernels import use_fla_causal_conv1d

log = logging.getLogger(__name__)


def _text_config(config: Any) -> Any:
    """The decoder's config: `text_config` for VLM wrappers (qwen3_5), the config itself otherwise."""
    getter = getattr(config, "get_text_config", None)
    return getter() if getter is not None else config


def check_capture_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Captured layer ids (`shards.layers` rules) that are also distinct and increasing: hooks fire in order."""
    ids = list(check_layer_ids(layer_ids, num_layers, what="captured layer ids"))
    if sorted(set(ids)) != ids:
        raise ValueError(f"captured layer ids {ids} must be distinct and increasing, e.g. {sorted(set(ids))}")
    return ids


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence the load report: the truncated layers are intentionally unexpected keys."""
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)


class CapturingTarget:
    """A truncated decoder with hooks on the captured layers; `capture` runs it without logits."""

    def __init__(self, model: torch.nn.Module, layer_ids: Sequence[int]):
        self.model = model
        self.decoder = model.model  # the inner model: never lm_head
        self.layer_ids = list(layer_ids)
        layers = self.decoder.layers
        if max(self.layer_ids) >= len(layers):
            raise ValueError(
                f"captured layer {max(self.layer_ids)} is beyond the {len(layers)} loaded layers"
            )
        self._captured: dict[int, torch.Tensor] = {}
        self._compiled: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []  # (layer, name, original)
        self._compile_failed = False  # once the compiled forward failed, this target stays eager
        self._handles = [layers[i].register_forward_hook(self._hook(i)) for i in self.layer_ids]
        first = next(self.decoder.parameters())
        self.device = first.device
        self.dtype = first.dtype
        self.hidden_size = int(_text_config(model.config).hidden_size)

    def _hook(self, layer_id: int):
        def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            # Decoder layers return a tensor in transformers 5 and a tuple in older releases.
            self._captured[layer_id] = output[0] if isinstance(output, (tuple, list)) else output

        return hook

    def speed_up(self, *, compile: bool = False) -> list[str]:
        """Faster kernels for the same math, on CUDA only; returns what was applied (for the log)."""
        if self.device.type != "cuda":
            return []
        applied = [f"FLA short convolution ({m})" for m in use_fla_causal_conv1d(self.model, self.device)]
        if compile and not self._compiled and not self._compile_failed:
            for layer in self.decoder.layers:
                # The capture hooks sit on the layers themselves: compile their parts, not the layers.
                for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
                    part = getattr(layer, name, None)
                    if isinstance(part, torch.nn.Module):
                        setattr(layer, name, torch.compile(part, dynamic=True))
                        self._compiled.append((layer, name, part))
            applied.append("torch.compile of attention, MLP and norms")
        return applied

    def _uncompile(self, exc: BaseException) -> None:
        detail = (str(exc).strip().splitlines() or [""])[0][:300]
        log.warning(
            "the compiled forward failed (%s: %s); continuing in eager mode", type(exc).__name__, detail
        )
        for layer, name, original in self._compiled:
            setattr(layer, name, original)
        self._compiled = []
        self._compile_failed = True

    @torch.inference_mode()
    def capture(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Run right-padded rows [B, S]; return each captured layer's output [B, S, H] in layer_ids order.

        No mask is needed for right padding (see the module docstring); one may still be given.
        """
        self._captured.clear()
        try:
            try:
                self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:
                if not self._compiled:
                    raise
                self._uncompile(exc)
                self._captured.clear()
                self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            return [self._captured[i] for i in self.layer_ids]
        finally:
            self._captured.clear()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def load_target(
    path: str | Path,
    layer_ids: Sequence[int],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
) -> CapturingTarget:
    """Load only layers 0..max(layer_ids) of a local HF causal LM onto `device` and hook the captured ones.

    dtype defaults to bf16 on CUDA and fp32 on CPU.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    info = read_target_config(path)
    layer_ids = check_capture_ids(layer_ids, info.num_hidden_layers)
    keep = max(layer_ids) + 1

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    config = copy.deepcopy(config)
    text = _text_config(config)
    # Truncate in the (text) config object and pass it whole: for the VLM-wrapped qwen3_5 the layer
    # count lives in text_config, where from_pretrained(num_hidden_layers=...) cannot reach it.
    text.num_hidden_layers = keep
    if getattr(text, "layer_types", None) is not None:
        text.layer_types = list(text.layer_types)[:keep]
    text.use_cache = False
    kwargs: dict[str, Any] = {"config": config, "dtype": dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with _quiet_transformers():
        model, loading = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kwargs)
    missing = sorted(k for k in loading.get("missing_keys", ()) if not k.startswith("lm_head"))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(
            f"target {path}: weights missing from the checkpoint ({shown}); they would be random. "
            "Is this a causal-LM checkpoint transformers can load (try --trust-remote-code)?"
        )
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        raise ValueError(f"target {path}: {type(model).__name__} has no .model.layers; not a decoder-only LM")
    # The logits head is never used; free it (it is the largest matrix of a Qwen model).
    if hasattr(model, "lm_head"):
        model.lm_head = torch.nn.Identity()
    model.eval().requires_grad_(False)
    model.to(device)
    log.info(
        "loaded %s (%s): layers 0..%d of %d, %s on %s",
        path,
        info.model_type,
        keep - 1,
        info.num_hidden_layers,
        dtype,
        device,
    )
    return CapturingTarget(model, layer_ids)
