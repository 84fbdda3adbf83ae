"""The quality benchmark's target LM: its BPE tokenizer, its shape (a Qwen3 LM, or with `TargetSpec.kind` "hybrid"
Qwen3.5's Gated DeltaNet decoder) and its next-token training, under deterministic kernels so that a build's
weights digest names it on any machine. The target is saved the way released small Qwen3 checkpoints are (bf16
safetensors, tied embeddings, embedding rows padded past the tokenizer), so the benchmark also exercises that
layout end to end. What it trains on and what it answers: `quality_data`.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import platform
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

PAD = "<|endoftext|>"

COMPILE_MODES = (
    "default",
    "reduce-overhead",
    "max-autotune",
    "max-autotune-no-cudagraphs",
)  # torch.compile's


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetSpec:
    """The target LM and how long it trains. `kind`: "code" (a Qwen3 LM on Python sources), "prose" (the
    same shape on chat rows of docstrings and documents, `quality_prose`) or "hybrid" (a Qwen3.5 text LM,
    Gated DeltaNet and full attention layers 3:1, on the code corpus)."""

    vocab: int  # BPE vocabulary (the embedding table is padded past it: the mask token's row)
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    seq_len: int
    batch: int
    steps: int
    lr: float
    corpus_mb: float  # text read from the source files (train + held-out)
    bpe_mb: float  # of which the tokenizer learns from
    kind: str = "code"
    # A torch.compile mode for the training step's model ("default", "reduce-overhead", ...); None: eager. On
    # the H200 the hybrid's torch delta rule (the only one that trains there, `torch_delta_rule_for_training`)
    # trained the full size's 2500 steps in 283 s eager (8.8 steps/s) and in 317 s with "reduce-overhead"
    # (CUDA graphs: 15 steps/s after ~150 s of compiling; "default" once gave +17%), BENCHMARKS.md: the compile
    # costs more than it saves at this length, so it is off by default. A compiled build is another target
    # (other weights from the same seed), though `work_mismatch` takes it as the same shape.
    compile: str | None = None


def build_tokenizer(
    texts: list[str], vocab: int, out: Path, max_bytes: int, extra_special: tuple[str, ...] = ()
) -> Any:
    """Byte-level BPE learned from the first `max_bytes` of `texts`, saved as an HF tokenizer in `out`;
    `extra_special` tokens (the chat markers) are single tokens after PAD."""
    from dflash.tools.tiny import train_bpe_tokenizer

    sample, used = [], 0
    for t in texts:
        sample.append(t)
        used += len(t)
        if used >= max_bytes:
            break
    return train_bpe_tokenizer(
        sample, out, vocab_size=vocab, special_tokens=[PAD, *extra_special], eos_token=PAD, pad_token=PAD
    )


def tokenize_files(tokenizer: Any, texts: list[str]) -> list[np.ndarray]:
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [np.asarray(ids, dtype=np.int32) for ids in encoded]


TARGET_KINDS = ("code", "prose", "hybrid")


class SizedVocab:
    """What `target_config` reads of a tokenizer, and nothing else: its length and the pad token's id (0). For
    building a target's shape without a trained tokenizer (tests, `bench/bench_target_determinism.py`)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def convert_tokens_to_ids(self, _token: str) -> int:
        return 0


def target_config(spec: TargetSpec, tokenizer: Any) -> Any:
    from dflash.tools.tiny import padded_vocab_size

    pad_id = tokenizer.convert_tokens_to_ids(PAD)
    shape = dict(
        vocab_size=padded_vocab_size(len(tokenizer)),
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.hidden // spec.heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=pad_id,
        pad_token_id=pad_id,
        bos_token_id=None,
    )
    if spec.kind == "hybrid":
        return hybrid_config(spec, shape)
    from transformers import Qwen3Config

    return Qwen3Config(**shape, rope_theta=1e6)


def hybrid_config(spec: TargetSpec, shape: dict[str, Any]) -> Any:
    """Qwen3.5's text decoder scaled down: three Gated DeltaNet layers to one full attention layer, twice as
    many value heads as key heads, a 4-tap short convolution and a quarter of each head rotated, as the
    released configs have. Keys and values each span half the hidden size (key heads as wide as the attention
    heads, value heads half as wide), so the model holds what the code target does within 2% at every size."""
    from transformers import Qwen3_5TextConfig

    head_dim = spec.hidden // spec.heads
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(spec.layers)]
    return Qwen3_5TextConfig(
        **shape,
        layer_types=layer_types,
        linear_num_key_heads=max(1, spec.heads // 2),
        linear_num_value_heads=spec.heads,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=max(1, head_dim // 2),
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
    )


def target_model(config: Any) -> Any:
    """A freshly initialised causal LM of `config` (Qwen3, or Qwen3.5's text decoder)."""
    if config.model_type == "qwen3_5_text":
        from transformers import Qwen3_5ForCausalLM

        return Qwen3_5ForCausalLM(config)
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM(config)


@contextlib.contextmanager
def deterministic_kernels(strict: bool = True) -> Iterator[None]:
    """Torch's deterministic algorithms for the block (the previous setting restored after it)."""
    # Three H200 machines trained three targets from one code and seed (prompt lookup walks 2.775-2.883), so
    # the benchmark's baseline moved between sessions. Deterministic kernels (the embedding's backward, cuBLAS
    # workspaces) remove the GPU's share of that. Warn-only, that let cuDNN's attention backward through: two
    # builds side by side on one H200 came out different (prompt lookup 2.720 and 2.632 on their rows). Strict,
    # cuDNN picks its deterministic algorithm, at no cost measured, and a kernel with none stops the build at
    # its first step, naming itself, rather than build another target (BENCHMARKS.md). The weights' digest in
    # bench_target.json says whether two builds agree; the corpus digest whether their sources did.
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=not strict)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic, warn_only=was_warn_only)


SOFTWARE = ("torch", "transformers", "tokenizers", "numpy", "flash-linear-attention", "triton")


def software(device: str) -> dict[str, str]:
    """The versions a build or a run used, and the GPU's name: strict kernels repeat a target's weights on one
    stack, not across torch or transformers releases (the prose `cpu` target's weights changed with the
    library versions between two sessions: BENCHMARKS.md), so a report says which stack made its numbers."""
    import torch

    found = {"python": platform.python_version()}
    for name in SOFTWARE:
        with contextlib.suppress(metadata.PackageNotFoundError):  # FLA and triton are optional
            found[name] = metadata.version(name)
    if device.startswith("cuda") and torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name(torch.device(device))
        found["cuda"] = str(torch.version.cuda)
    return found


def train_target(
    spec: TargetSpec,
    tokenizer: Any,
    files: list[np.ndarray],
    out: Path,
    device: str,
    seed: int,
    strict: bool = True,
) -> dict[str, Any]:
    """Next-token training on random windows of the training files; saved in bf16 with tied embeddings.
    `strict=False` only warns where a kernel is nondeterministic (how targets were built before: a control
    for `bench/bench_target_determinism.py`)."""
    with deterministic_kernels(strict):
        info = _train_target(spec, tokenizer, files, out, device, seed)
    info["built_with"] = software(device)
    info["weights_sha256"] = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    return info


def _train_target(
    spec: TargetSpec, tokenizer: Any, files: list[np.ndarray], out: Path, device: str, seed: int
) -> dict[str, Any]:
    import torch

    torch.manual_seed(seed)
    stream = np.concatenate(files)
    rng = np.random.default_rng(seed)
    config = target_config(spec, tokenizer)
    model = target_model(config).to(device)
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device == "cuda" or None
    )
    warmup = max(1, spec.steps // 20)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")
    # on CUDA FLA's gated delta-rule backward is refused (torch_delta_rule_for_training says why)
    patch = torch_delta_rule_for_training(model) if device == "cuda" else contextlib.nullcontext()
    with patch as delta_rule:
        # `model` itself is what is saved
        forward = (
            torch.compile(model, mode=None if spec.compile == "default" else spec.compile)
            if spec.compile
            else model
        )
        losses = []
        start = time.perf_counter()
        for step in range(spec.steps):
            if spec.compile:  # a new step: CUDA graphs may reuse the last step's outputs' memory
                torch.compiler.cudagraph_mark_step_begin()
            frac = min(1.0, (step + 1) / warmup)
            progress = max(0.0, (step - warmup) / max(1, spec.steps - warmup))
            for group in optimizer.param_groups:
                group["lr"] = spec.lr * frac * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
            offsets = rng.integers(0, len(stream) - spec.seq_len - 1, spec.batch)
            batch = torch.from_numpy(
                np.stack([stream[o : o + spec.seq_len] for o in offsets]).astype(np.int64)
            )
            batch = batch.to(device)
            with autocast:
                loss = forward(input_ids=batch, labels=batch, use_cache=False).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if step % 50 == 0 or step == spec.steps - 1:
                losses.append((step, float(loss.detach())))
            # a detached run's log says how far the target is (bench/quality_targets.sh)
            if step % 500 == 499:
                print(f"[target] step {step + 1}/{spec.steps}, loss {losses[-1][1]:.3f}, "
                      f"{time.perf_counter() - start:.0f} s", flush=True)  # fmt: skip
        seconds = time.perf_counter() - start
    model.eval()
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.to(torch.bfloat16).save_pretrained(str(out))  # bf16, tied: like Qwen3-0.6B/1.7B/4B on the Hub
    info = {
        "params": sum(p.numel() for p in model.parameters()),
        "train_tokens": spec.steps * spec.batch * spec.seq_len,
        "first_loss": losses[0][1],
        "final_loss": float(np.mean([v for _, v in losses[-3:]])),
        "seconds": round(seconds, 1),
        "spec": asdict(spec),
    }
    if delta_rule:
        info["delta_rule_in_training"] = delta_rule
    return info


def torch_code(fn: Any) -> Any:
    """The function under transformers' dispatch wrappers: `functools.wraps` chains (`__wrapped__`) and, since
    transformers requires `kernels` (5.25), the `Func` module that wraps the dispatcher, whose `forward` closes
    over the function it calls."""
    import inspect

    while True:
        fn = inspect.unwrap(fn)
        forward = getattr(type(fn), "forward", None)
        names = getattr(getattr(forward, "__code__", None), "co_freevars", ())
        if "func" not in names:
            return fn
        fn = forward.__closure__[names.index("func")].cell_contents


@contextlib.contextmanager
def torch_delta_rule_for_training(model: Any) -> Iterator[str | None]:
    """Within it, `model`'s Gated DeltaNet layers run transformers' torch chunked delta rule, not FLA's kernel.

    FLA 0.6.0 refuses the gated delta rule's backward on Hopper with Triton 3.4-3.7.0 (wrong gradients, its
    issue #640), and the GPU machine's torch 2.11 comes with Triton 3.6. Only the target's own training runs
    a backward: generation and `dflash-extract` (forward only) keep FLA's kernels. Transformers picks FLA in
    one of two ways by version: a per-layer attribute (`chunk_gated_delta_rule`) or a module-level function
    decorated to dispatch to FLA when it imports (`torch_chunk_gated_delta_rule`; `torch_code` finds the torch
    code under it); both are pointed at the torch code and restored on exit. Yields what ran."""
    import sys

    restore: list[tuple[Any, str, Any]] = []
    for module in model.modules():
        layer_fn = getattr(module, "chunk_gated_delta_rule", None)
        modeling = sys.modules[type(module).__module__]
        torch_fn = getattr(modeling, "torch_chunk_gated_delta_rule", None)
        if torch_fn is None:
            continue
        code = torch_code(torch_fn)
        if callable(layer_fn):
            restore.append((module, "chunk_gated_delta_rule", layer_fn))
            module.chunk_gated_delta_rule = code
        if code is not torch_fn:  # not yet patched: the torch code is its own
            restore.append((modeling, "torch_chunk_gated_delta_rule", torch_fn))
            modeling.torch_chunk_gated_delta_rule = code
    try:
        yield f"transformers' torch chunked delta rule ({len(restore)} patched)" if restore else None
    finally:
        for owner, name, original in reversed(restore):
            setattr(owner, name, original)
