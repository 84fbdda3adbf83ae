"""What the extraction benches share: random-weight truncated targets of real shapes, synthetic rows with the
902k-row set's length distribution, and the bare forward over staged batches (the benches' reference)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from dflash.extract.dataset import open_dataset
from dflash.extract.gather import gather
from dflash.extract.plan import plan_batches
from dflash.extract.target import CapturingTarget
from dflash.extract.validate import validate

from bench.shapes import QWEN3_8B, QWEN35_27B, TINY, config_kwargs

MEDIAN_LEN, SIGMA, MIN_LEN, MAX_LEN_CLIP = 1450, 0.8, 16, 8192

# Captured layers: the DFlash default rule (K = 5) for the real shapes; two early layers for the tiny one.
ARCHS = {
    "qwen3_8b": dict(shape=QWEN3_8B, layers=[1, 9, 17, 25, 33], rows=300),
    "qwen35_27b": dict(shape=QWEN35_27B, layers=[1, 16, 31, 46, 61], rows=150),
    "tiny": dict(shape=TINY, layers=[1, 2], rows=40),
}


def _model_config(shape: dict, num_layers: int):
    params = config_kwargs(shape, num_layers)
    if shape["model_type"] == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**params)
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**params)


def _random_model(arch: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The random-weight model of `arch` truncated after its last captured layer (seed 0: the same on every
    process that builds it)."""
    from transformers import AutoModelForCausalLM

    spec = ARCHS[arch]
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            _model_config(spec["shape"], max(spec["layers"]) + 1), dtype=dtype
        )
    return model.eval().requires_grad_(False)


def write_target_stub(arch: str, target_dir: Path, embed: torch.Tensor, lm_head: torch.Tensor) -> Path:
    """A target directory without decoder weights: config.json with the full layer count, as a real
    checkpoint has, and the embed/lm_head matrices CACHE/target/ copies."""
    from safetensors.torch import save_file

    shape = ARCHS[arch]["shape"]
    target_dir.mkdir(parents=True, exist_ok=True)
    _model_config(shape, shape["num_hidden_layers"]).save_pretrained(target_dir)
    tensors = {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head}
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(target_dir / "model.safetensors")
    )
    return target_dir


def build_target(
    arch: str, workdir: Path, device: torch.device, dtype: torch.dtype
) -> tuple[Path, CapturingTarget]:
    """Random-weight truncated model in memory + a target dir (config.json, embed/lm_head safetensors)."""
    model = _random_model(arch, device, dtype)
    target_dir = write_target_stub(
        arch, workdir / f"target-{arch}", model.model.embed_tokens.weight, model.lm_head.weight
    )
    model.lm_head = torch.nn.Identity()  # never used for extraction
    return target_dir, CapturingTarget(model, ARCHS[arch]["layers"])


def target_from_stub(
    arch: str, target_dir: Path, device: torch.device, dtype: torch.dtype
) -> CapturingTarget:
    """The random-weight truncated model of `arch` with the stub's embedding, so states and the cache's
    frozen parts belong to one target (each process of a multi-process run builds it the same way)."""
    from safetensors import safe_open

    model = _random_model(arch, device, dtype)
    with safe_open(str(target_dir / "model.safetensors"), framework="pt") as f:
        model.model.embed_tokens.weight.copy_(f.get_tensor("model.embed_tokens.weight"))
    model.lm_head = torch.nn.Identity()
    return CapturingTarget(model, ARCHS[arch]["layers"])


def write_rows(path: Path, rows: int, vocab: int, seed: int = 0, max_clip: int = MAX_LEN_CLIP) -> Path:
    """One Arrow IPC file: int32 ids, int8 loss mask (first ~20% prompt), 1000-row record batches."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(MEDIAN_LEN), SIGMA, rows)), MIN_LEN, max_clip).astype(
        np.int64
    )
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = rng.integers(0, vocab, size=int(offsets[-1]), dtype=np.int32)
    prompt = (lengths * rng.uniform(0.05, 0.4, rows)).astype(np.int64)
    pos = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], lengths)
    mask = (pos >= np.repeat(prompt, lengths)).astype(np.int8)
    table = pa.table(
        {
            "input_ids": pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(ids)),
            "loss_mask": pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(mask)),
            "seq_len": pa.array(lengths),
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=1000):
            writer.write_batch(batch)
    return path


def stage_batches(
    target: CapturingTarget, dataset: Path, vocab: int, max_len: int, token_budget: int, mask: bool
) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]:
    """Every planned batch on the device: (int64 ids [B, S], int64 mask or None, lengths [B])."""
    ds = open_dataset(dataset)
    report = validate(ds, vocab_size=vocab, max_len=max_len)
    staged = []
    for batch in plan_batches(report.rows, report.lengths, token_budget=token_budget):
        g = gather(ds, batch, None)
        ids = torch.as_tensor(g.input_ids).to(target.device)
        am = torch.as_tensor(g.attention_mask).to(target.device) if mask else None
        staged.append((ids, am, torch.as_tensor(g.lengths)))
    return staged


def timed_pass(target: CapturingTarget, staged: list) -> dict:
    """Forward every staged batch; wall seconds and GPU-busy seconds (CUDA events) over the pass."""
    cuda = target.device.type == "cuda"
    events = []
    t = time.perf_counter()
    for ids, am, _ in staged:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        target.capture(ids, am)
        if cuda:
            end.record()
            events.append((start, end))
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    batch_ms = [s.elapsed_time(e) for s, e in events]
    busy = sum(batch_ms) / 1e3 if cuda else wall
    # GPU ms per batch keyed by its real tokens, to set the pipeline's batches beside (`batch_excess`); a CPU
    # records no events, so nothing to key
    tokens = (int(lengths.sum()) for _, _, lengths in staged)
    by_tokens = dict(zip(tokens, batch_ms, strict=False))
    return {"seconds": wall, "gpu_busy_seconds": busy, "batch_ms": by_tokens}


def batch_excess(batch_times: list[tuple[int, float, float]], bare_ms: dict[int, float]) -> dict:
    """How much longer each pipeline batch's GPU compute took than the same batch's bare forward, and how
    long the main thread took to enqueue it: a systematic excess in every batch points at contention or a
    starved launching thread, one in the first batches only at warm-up (allocations, pinned blocks)."""
    pairs = [(ms - bare_ms[n], host) for n, ms, host in batch_times if n in bare_ms]
    if not pairs:
        return {}
    excess = sorted(e for e, _ in pairs)
    host = sorted(h for _, h in pairs)
    return {
        "batches": len(pairs),
        "excess_ms_total": sum(excess),
        "excess_ms_median": excess[len(excess) // 2],
        "excess_ms_p90": excess[int(len(excess) * 0.9)],
        "excess_ms_first3": [round(e, 2) for e, _ in pairs[:3]],
        "host_ms_median": host[len(host) // 2],
        "gpu_ms_median": sorted(ms for _, ms, _ in batch_times)[len(batch_times) // 2],
    }


# The caching allocators' counters that can stall a pipeline batch: a new device segment (cudaMalloc), one
# given back (cudaFree, which synchronizes the device), a retry after freeing cached blocks, and the pinned
# host pool growing or shrinking (cudaHostAlloc of a power-of-two block pins at a few GB/s: of the order of
# 0.1 s for 512 MiB).
DEVICE_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
HOST_COUNTERS = ("num_host_alloc", "num_host_free", "host_alloc_time.total", "host_free_time.total")


def allocator_counters(device: torch.device) -> dict[str, float]:
    """A snapshot of `DEVICE_COUNTERS` and `HOST_COUNTERS` (times in microseconds); empty off CUDA."""
    if device.type != "cuda":
        return {}
    snapshot = {k: float(v) for k, v in torch.cuda.memory_stats(device).items() if k in DEVICE_COUNTERS}
    host = torch.cuda.host_memory_stats()
    snapshot.update({f"host.{k}": float(v) for k, v in host.items() if k in HOST_COUNTERS})
    return snapshot


def counters_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What a run added to each counter (a counter missing from either snapshot is left out)."""
    return {k: after[k] - before[k] for k in after if k in before}
