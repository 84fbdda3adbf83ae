"""The quality benchmark's target and data: a small LM trained here on Python sources (a Qwen3 one, or with
`TargetSpec.kind` "hybrid" Qwen3.5's Gated DeltaNet decoder; "prose" trains the Qwen3 shape on the chat rows of
`quality_prose`), and its greedy continuations as the drafter's training and evaluation rows.

Nothing is downloaded: the corpus is the `.py` files of the standard library and of packages installed on
every machine that runs dflash (torch, transformers). Files are split by a hash of their relative path, so
evaluation prompts come from files the target and the drafter never trained on. The target is saved the way
released small Qwen3 checkpoints are (bf16 safetensors, tied embeddings, embedding rows padded past the
tokenizer), so the benchmark also exercises that layout end to end.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import math
import os
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

PAD = "<|endoftext|>"
CORPUS_PACKAGES = ("torch", "transformers")


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
    # ran 4.5 steps/s eager and 5.25 with "default" (BENCHMARKS.md): +17% once compiled, less than the compile
    # costs on a 2500-step target, so it is off by default. "reduce-overhead" (CUDA graphs: the step's shapes
    # never change) is not timed yet.
    compile: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class DataSpec:
    """Greedy continuations: prompts cut from files, the target's answers supervised."""

    train_rows: int
    eval_rows: int
    prompt_min: int
    prompt_max: int
    new_tokens: int
    gen_batch: int


# --- corpus -------------------------------------------------------------------------------------------


def package_roots() -> list[tuple[str, Path]]:
    """(name, folder) of each installed CORPUS_PACKAGES package."""
    roots = []
    for name in CORPUS_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots.append((name, Path(next(iter(spec.submodule_search_locations)))))
    return roots


def source_files() -> list[tuple[str, Path]]:
    """(stable name, path) of every .py file of the stdlib and CORPUS_PACKAGES, sorted by name."""
    roots = [("stdlib", Path(sysconfig.get_paths()["stdlib"])), *package_roots()]
    files = []
    for label, root in roots:
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).as_posix()
            if label == "stdlib" and rel.split("/")[0] in ("site-packages", "dist-packages"):
                continue
            files.append((f"{label}/{rel}", path))
    return sorted(files)


def is_heldout(name: str, fraction: float = 0.1) -> bool:
    """A file's split depends on its name only: the same file is held out on every machine."""
    digest = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return digest / 2**64 < fraction


def read_corpus(max_bytes: int, seed: int) -> tuple[list[str], list[str], dict[str, Any]]:
    """(train texts, held-out texts, stats): whole files in a seeded order until `max_bytes` are read."""
    files = source_files()
    order = np.random.default_rng(seed).permutation(len(files))
    train, held, used = [], [], 0
    for i in order:
        name, path = files[i]
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) < 2000:  # __init__ stubs and tiny files: nothing to continue
            continue
        (held if is_heldout(name) else train).append(text)
        used += len(text)
        if used >= max_bytes:
            break
    return train, held, corpus_stats(train, held, used, len(train) + len(held), len(held))


def corpus_stats(
    train: list[str], held: list[str], used: int, files: int, heldout_files: int
) -> dict[str, Any]:
    digest = hashlib.sha256()
    for text in train + held:  # what the target learns from: tells two machines' corpora apart
        digest.update(hashlib.sha256(text.encode()).digest())
    return {"files": files, "heldout_files": heldout_files, "bytes": used, "sha256": digest.hexdigest()}


# --- tokenizer and target ---------------------------------------------------------------------------------


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


# --- greedy continuations ---------------------------------------------------------------------------------


def cut_prompts(
    files: list[np.ndarray], n: int, spec: DataSpec, rng: np.random.Generator
) -> list[np.ndarray]:
    """`n` prompts: random windows of random files (length uniform in [prompt_min, prompt_max])."""
    usable = [f for f in files if len(f) > spec.prompt_max + 1]
    if not usable:
        raise ValueError("no source file is longer than prompt_max tokens")
    weights = np.array([len(f) for f in usable], dtype=np.float64)
    picks = rng.choice(len(usable), size=n, p=weights / weights.sum())
    prompts = []
    for i in picks:
        f = usable[i]
        length = int(rng.integers(spec.prompt_min, spec.prompt_max + 1))
        start = int(rng.integers(0, len(f) - length))
        prompts.append(f[start : start + length])
    return prompts


def greedy_continuations(
    target_dir: Path, prompts: list[np.ndarray], spec: DataSpec, pad_id: int, device: str
) -> list[np.ndarray]:
    """The target's greedy continuation of each prompt (`new_tokens` tokens, batched, left-padded), run in
    the dtype extraction will use (bf16 on CUDA), so the cached states are the ones that chose these tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).to(device).eval()
    order = np.argsort([len(p) for p in prompts], kind="stable")  # similar lengths share a batch
    result: dict[int, np.ndarray] = {}
    for begin in range(0, len(order), spec.gen_batch):
        idx = order[begin : begin + spec.gen_batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            p = torch.from_numpy(prompts[i].astype(np.int64))
            ids[row, width - len(p) :] = p
            mask[row, width - len(p) :] = 1
        # The same target gave other rows in another session (rows.arrow's digest differed, the weights' did
        # not): greedy decoding flips on bf16 rounding, so generation picks deterministic kernels too (warn
        # only: generate's ops were never run under strict mode on the GPU, and a stop here wastes the build).
        with torch.inference_mode(), deterministic_kernels(strict=False):
            generated = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                do_sample=False,
                max_new_tokens=spec.new_tokens,
                min_new_tokens=spec.new_tokens,  # code has no end: every row gets the same budget
                pad_token_id=pad_id,
            )
        new = generated[:, width:].cpu().numpy().astype(np.int32)
        for row, i in enumerate(idx):
            result[int(i)] = new[row]
    return [result[i] for i in range(len(prompts))]


def write_rows(path: Path, prompts: list[np.ndarray], answers: list[np.ndarray]) -> None:
    """An Arrow IPC file `dflash-extract` reads: input_ids = prompt + answer, loss_mask on the answer."""
    import pyarrow as pa

    # uint16 when the vocabulary allows: half the bytes to carry between machines (dflash reads any int type)
    vocab_max = max(int(max(p.max(), a.max())) for p, a in zip(prompts, answers, strict=True))
    id_type = (np.uint16, pa.uint16()) if vocab_max < 2**16 else (np.int32, pa.int32())
    ids = [np.concatenate([p, a]).astype(id_type[0]) for p, a in zip(prompts, answers, strict=True)]
    masks = [
        np.concatenate([np.zeros(len(p), np.int8), np.ones(len(a), np.int8)])
        for p, a in zip(prompts, answers, strict=True)
    ]
    table = pa.table(
        {
            "input_ids": pa.array(ids, type=pa.list_(id_type[1])),
            "loss_mask": pa.array(masks, type=pa.list_(pa.int8())),
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=4096)
    tmp.replace(path)
