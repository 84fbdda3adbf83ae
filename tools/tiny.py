"""The built-in tiny target and tokenizer: deterministic, offline, built in seconds on a CPU.

`build_tiny_target` trains a small BPE tokenizer and a small `Qwen3ForCausalLM` on the built-in chat
corpus (`tiny_corpus`), so its greedy answers are structured (counts, letter walks, repetitions,
templated facts) rather than the noise of random weights: a DFlash drafter trained on them can
learn to guess several tokens ahead, which makes the demo's tau meaningful. The result is one
complete HF directory (safetensors weights, config, tokenizer, chat template).

The embedding table is padded above `len(tokenizer)`, so row `len(tokenizer)` is free for the
drafter's mask token, as in real Qwen checkpoints (151669 of 151936).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from dflash.shards.progress import ProgressLine

from . import tiny_corpus
from .tiny_corpus import Conversation
from .tiny_train import reproducible_torch, train_on_chats

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)

# ChatML like Qwen's; `{% generation %}` marks what the assistant generates (content + end-of-turn),
# which is what `dflash-tokenize` supervises.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class TinySize:
    """Shape and training budget of a tiny target. `SIZES` holds the presets."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    bpe_vocab: int  # tokenizer size, special tokens included
    train_chats: int
    train_steps: int
    batch_size: int
    lr: float

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be a multiple of num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if min(self.num_layers, self.train_chats, self.train_steps, self.batch_size) < 1:
            raise ValueError(f"layers, chats, steps and batch size must be >= 1, got {self}")
        if self.bpe_vocab < 300:
            raise ValueError(
                f"bpe_vocab must be >= 300 (256 bytes + specials + merges), got {self.bpe_vocab}"
            )


# The demo's target: 0.27 M parameters, ~17 s of one CPU core. Measured (256 unseen prompts): 200 steps
# -> loss 0.33, 33% of answers exactly the corpus's; 300 steps -> 0.25, 57%, but 9 s more. Either
# way the answers are templated: a 4-gram model drafting from the answers alone reaches tau ~5.
_DEMO = TinySize(
    hidden_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=192,
    bpe_vocab=512,
    train_chats=4000,
    train_steps=200,
    batch_size=32,
    lr=1e-2,
)
SIZES: dict[str, TinySize] = {
    "demo": _DEMO,
    # For tests: the demo's architecture (heads, KV heads) and learning rate, narrower and shallower, a
    # smaller tokenizer, a few seconds of training.
    "test": replace(
        _DEMO,
        hidden_size=32,
        num_layers=2,
        intermediate_size=64,
        bpe_vocab=384,
        train_chats=300,
        train_steps=30,
        batch_size=16,
    ),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class TinyTargetInfo:
    """What `build_tiny_target` made: written as `OUT/tiny_build.json` too."""

    path: str
    size: str
    seed: int
    vocab_size: int  # rows of the embedding table
    tokenizer_len: int  # len(tokenizer); rows >= this are free (the first is the drafter's mask token)
    num_parameters: int
    first_loss: float
    final_loss: float
    train_seconds: float
    train_cpu_seconds: float  # CPU time: what an idle box would take, whatever the load here
    build_seconds: float


def _resolve_size(size: str | TinySize) -> tuple[str, TinySize]:
    if isinstance(size, TinySize):
        return "custom", size
    if size not in SIZES:
        raise ValueError(f"unknown tiny size {size!r}; choose one of {sorted(SIZES)} or pass a TinySize")
    return size, SIZES[size]


@contextlib.contextmanager
def _quiet_transformers():
    """No progress bars or info logs from transformers while loading/saving the tiny model (restored after)."""
    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def build_tiny_tokenizer(out_dir: str | Path, *, vocab_size: int = 512, seed: int = 0):
    """Train a byte-level BPE on the built-in text and save it (with the chat template) to `out_dir`.

    Returns the `PreTrainedTokenizerFast`. eos is `<|im_end|>`, pad `<|endoftext|>`, no bos (like Qwen).
    """
    return train_bpe_tokenizer(
        tiny_corpus.tokenizer_texts(seed),
        out_dir,
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
        padding_side="right",
    )


def train_bpe_tokenizer(
    texts: Iterable[str],
    out_dir: str | Path,
    *,
    vocab_size: int,
    special_tokens: Sequence[str],
    eos_token: str,
    pad_token: str,
    **hf_options: Any,
):
    """A byte-level BPE learned from `texts` (any text encodes: no unknown token), saved to `out_dir` as an
    HF `PreTrainedTokenizerFast` and returned; `hf_options` go to that class (chat template, padding side)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=eos_token, pad_token=pad_token, **hf_options
    )
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def padded_vocab_size(tokenizer_len: int) -> int:
    """Embedding rows for a tokenizer: a multiple of 64 with at least one free row (the drafter's mask token),
    as released Qwen checkpoints pad theirs (151,669 tokens, 151,936 rows)."""
    return 64 * math.ceil((tokenizer_len + 1) / 64)


def _model_config(size: TinySize, tokenizer):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=padded_vocab_size(len(tokenizer)),
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_kv_heads,
        head_dim=size.hidden_size // size.num_heads,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )


def build_tiny_target(out_dir: str | Path, *, size: str | TinySize = "demo", seed: int = 0) -> TinyTargetInfo:
    """Build the tokenizer and train the tiny Qwen3 target into `out_dir` (a complete HF directory).

    Deterministic: the same size and seed give identical weights on the same machine and torch build.
    """
    import torch
    from transformers import Qwen3ForCausalLM

    start = time.perf_counter()
    size_name, spec = _resolve_size(size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(out, vocab_size=spec.bpe_vocab, seed=seed)
    config = _model_config(spec, tokenizer)
    texts = tokenizer.apply_chat_template(tiny_corpus.training_chats(spec.train_chats, seed), tokenize=False)
    token_rows = tokenizer(texts, add_special_tokens=False)["input_ids"]

    with reproducible_torch(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
        train_start, cpu_start = time.perf_counter(), time.process_time()
        first, final = train_on_chats(model, token_rows, tokenizer.pad_token_id, spec, seed)
        train_seconds, cpu_seconds = time.perf_counter() - train_start, time.process_time() - cpu_start
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.do_sample = False
    with _quiet_transformers():
        model.save_pretrained(str(out))
    info = TinyTargetInfo(
        path=str(out),
        size=size_name,
        seed=seed,
        vocab_size=config.vocab_size,
        tokenizer_len=len(tokenizer),
        num_parameters=sum(p.numel() for p in model.parameters()),
        first_loss=round(first, 4),
        final_loss=round(final, 4),
        train_seconds=round(train_seconds, 2),
        train_cpu_seconds=round(cpu_seconds, 2),
        build_seconds=round(time.perf_counter() - start, 2),
    )
    (out / "tiny_build.json").write_text(json.dumps(asdict(info), indent=2) + "\n")
    return info


def builtin_prompts(n: int, *, seed: int = 1) -> list[Conversation]:
    """`n` deterministic chat prompts (no assistant turn) in the corpus's style; seed 1 differs from training."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return [conv for conv, _answer in tiny_corpus.prompts(n, seed)]


def generate_completions(
    target_dir: str | Path,
    tokenizer_dir: str | Path,
    prompts: Sequence[Conversation],
    max_new_tokens: int,
    *,
    batch_size: int = 128,
) -> list[Conversation]:
    """The target answers each prompt greedily: returns each prompt plus its assistant turn.

    Batched with left padding; the answer is the decoded text up to `<|im_end|>` (or `max_new_tokens`).
    This is the target-regenerated data DFlash trains on.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens and batch_size must be >= 1, got {max_new_tokens}, {batch_size}")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.padding_side = "left"
    with _quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    model.eval()
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    out: list[Conversation] = []
    progress = ProgressLine("generate", len(prompts), "prompt")
    for begin in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[begin : begin + batch_size]]
        enc = tokenizer.apply_chat_template(
            chunk,
            add_generation_prompt=True,
            tokenize=True,
            padding=True,
            return_dict=True,
            return_tensors="pt",
        )
        with reproducible_torch(), torch.inference_mode():
            generated = model.generate(
                input_ids=enc["input_ids"],
                attention_mask=enc["attention_mask"],
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        new_tokens = generated[:, enc["input_ids"].shape[1] :]
        for prompt, row in zip(chunk, new_tokens.tolist(), strict=True):
            if eos_id in row:
                row = row[: row.index(eos_id)]
            text = tokenizer.decode(row, skip_special_tokens=True)
            out.append([*prompt, {"role": "assistant", "content": text}])
        progress.update(len(chunk))
    progress.close()
    return out


def write_chat_jsonl(conversations: Sequence[Conversation], path: str | Path) -> Path:
    """Write conversations as OpenAI-style `{"messages": [...]}` JSON lines (the input of `dflash-tokenize`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for conv in conversations:
            f.write(json.dumps({"messages": conv}, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path
