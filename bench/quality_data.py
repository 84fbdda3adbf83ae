"""The quality benchmark's data: the corpus its target (`quality_target`) learns from, Python sources (or with
`TargetSpec.kind` "prose" the chat rows of `quality_prose`), and the target's greedy continuations as the
drafter's training and evaluation rows.

Nothing is downloaded: the corpus is the `.py` files of the standard library and of packages installed on
every machine that runs dflash (torch, transformers). Files are split by a hash of their relative path, so
evaluation prompts come from files the target and the drafter never trained on.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.quality_target import deterministic_kernels

CORPUS_PACKAGES = ("torch", "transformers")


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
