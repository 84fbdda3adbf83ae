"""The drafter's attention alone, forward and backward, on one pack shaped like the quality benchmark's rows.

    python3 bench/bench_attention.py [--budget 8192] [--lengths 256,384] [--variants joint,split,ctx,...]

Where the training step's attention time goes (BENCHMARKS.md: ~36 ms of a ~60 ms step at the full size), and
what a kernel of the same work could take. One layer's q [1, 6, M, 64], k/v [1, 2, T + M, 64] in bf16 (M = N x B
block slots, T context tokens), the pack's real layout (`make_packed_batch`, every response position an
anchor, the first fifth of each row prompt); per variant: ms forward, ms forward + backward, and TFLOP/s
counted on the visible pairs only (4 * pairs * heads * D forward, 2.5x that backward), so a variant that
visits masked pairs is charged for them. Variants:

    joint      FlexAttention over [context | slots], one BlockMask (the trainer's default, `mask.FORWARD_TILE`)
    split      FlexAttention over the context, own slots dense, merged (`--split-own-slots`)
    joint-default, split-default   the same with Inductor's default forward tile
    joint-mRnK the trainer's kernel with an R x K forward tile instead (R, K dividing the BlockMask's 128 x 128)
    ctx        FlexAttention over the context alone (split's first part; its tile density printed)
    ctx-K      ctx with FlexAttention kernel_options K (see KERNEL_OPTIONS)
    ctx-autotune  ctx compiled in max-autotune-no-cudagraphs mode (Inductor tries its kernel configs)
    rows-sdpa  the context as a padded batch of rows: SDPA with a boolean mask per row (no FlexAttention)
    causal     roofline: FlexAttention (64 x 128 forward tile) over a plain causal mask with as many visible
               pairs, one sequence
    flash      roofline: SDPA's own causal kernel on the same
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash.train import mask as mask_module
from dflash.train.blocks import PackedBatch, SequenceInput, make_packed_batch
from dflash.train.mask import FlexMask

from bench.step_variants import packed_lengths

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 64, 16
KERNEL_OPTIONS: dict[str, dict[str, object]] = {
    "m64n64": {"BLOCK_M": 64, "BLOCK_N": 64},
    "m32n128": {"BLOCK_M": 32, "BLOCK_N": 128},
    "m32n64": {"BLOCK_M": 32, "BLOCK_N": 64},
    "m64n128": {"BLOCK_M": 64, "BLOCK_N": 128},
    "m128n64": {"BLOCK_M": 128, "BLOCK_N": 64},
    "m64n128-tma": {"BLOCK_M": 64, "BLOCK_N": 128, "USE_TMA": True},
    "m64n128-w8": {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8},
    "m64n128-bw8": {
        "BLOCK_M": 64,
        "BLOCK_N": 128,
        "BLOCK_M1": 64,
        "BLOCK_N1": 128,
        "BLOCK_M2": 128,
        "BLOCK_N2": 64,
        "num_warps": 8,
    },
}
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def make_pack(budget: int, low: int, high: int, seed: int) -> PackedBatch:
    gen = torch.Generator().manual_seed(seed)
    seqs = [
        SequenceInput(
            torch.randint(0, 4000, (s,), generator=gen), torch.arange(s) >= s // 5, torch.zeros(s, 1)
        )
        for s in packed_lengths(budget, low, high, 1, seed)[0]
    ]
    return make_packed_batch(seqs, block_size=BLOCK, mask_token_id=4095, num_anchors=512, generator=gen)


def context_pairs(batch: PackedBatch) -> int:
    return int(batch.anchor_pos[batch.block_seq >= 0].sum()) * BLOCK


def rows_sdpa(batch: PackedBatch, device: torch.device) -> Attend:
    """The context keys as a padded batch of rows, each row's blocks' slots its queries; SDPA with a mask."""
    seqs = batch.block_seq.tolist()
    starts = torch.searchsorted(batch.context_seq, torch.arange(int(batch.context_seq.max()) + 1))
    ends = torch.cat([starts[1:], torch.tensor([batch.num_context_tokens])])
    rows = sorted(set(s for s in seqs if s >= 0))
    blocks = [[n for n, s in enumerate(seqs) if s == r] for r in rows]
    n_max, l_max = max(map(len, blocks)), int((ends - starts).max())
    q_index = torch.full((len(rows), n_max * BLOCK), -1, dtype=torch.long)
    k_index = torch.zeros(len(rows), l_max, dtype=torch.long)
    allowed = torch.zeros(len(rows), 1, n_max * BLOCK, l_max, dtype=torch.bool)
    for i, (r, bl) in enumerate(zip(rows, blocks, strict=True)):
        slots = (torch.tensor(bl)[:, None] * BLOCK + torch.arange(BLOCK)).flatten()
        q_index[i, : slots.numel()] = slots
        length = int(ends[r] - starts[r])
        k_index[i, :length] = torch.arange(int(starts[r]), int(ends[r]))
        anchors = batch.anchor_pos[bl].repeat_interleave(BLOCK)
        allowed[i, 0, : slots.numel()] = torch.arange(l_max)[None, :] < anchors[:, None]
    # rows with no visible key (padding) see key 0, their output dropped on the way back
    allowed[..., 0] |= ~allowed.any(-1)
    q_index, k_index, allowed = q_index.to(device), k_index.to(device), allowed.to(device)
    real = q_index >= 0
    groups = HEADS // KV_HEADS

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qr = q[0][:, q_index.clamp_min(0)].transpose(0, 1)  # [R, H, n_max * B, D]
        kr = k[0][:, k_index].transpose(0, 1).repeat_interleave(groups, dim=1)
        vr = v[0][:, k_index].transpose(0, 1).repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=allowed)
        flat = q.new_zeros(q.shape[2], q.shape[1], q.shape[3])  # [M, H, D]
        return flat.index_put((q_index[real],), out.transpose(1, 2)[real]).transpose(0, 1)[None]

    return attend


def variant(batch: PackedBatch, name: str, device: torch.device) -> tuple[Attend, int]:
    """attend(q, k, v) over the whole [context | slots] keys, and the number of key positions it needs (0: the
    pack's). Each variant starts from fresh compiled functions (no recompile limit shared between them)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()
    tile = re.fullmatch(r"joint-m(\d+)n(\d+)", name)
    forward_tile = (int(tile[1]), int(tile[2])) if tile else mask_module.FORWARD_TILE
    mask_module.reset_flex(forward_tile=None if name.endswith("-default") else forward_tile)
    t, scale = batch.num_context_tokens, HEAD_DIM**-0.5
    if name.startswith(("joint", "split")):
        mask = FlexMask.from_batch(batch, split=name.startswith("split"))
        return (lambda q, k, v: mask.attend(q, k, v, scale)), 0
    if name == "ctx" or name.startswith("ctx-"):
        ctx_mask = FlexMask.from_batch(batch, split=True).block_mask
        options = KERNEL_OPTIONS.get(name[4:]) if name != "ctx" else None
        mode = "max-autotune-no-cudagraphs" if name == "ctx-autotune" else None
        fn = torch.compile(flex_attention, mode=mode)

        def attend(q, k, v):
            return fn(q, k[:, :, :t], v[:, :, :t], block_mask=ctx_mask, scale=scale, enable_gqa=True,
                      kernel_options=options)  # fmt: skip

        return attend, 0
    if name == "rows-sdpa":
        fn = rows_sdpa(batch.to("cpu"), device)
        return (lambda q, k, v: fn(q, k[:, :, :t], v[:, :, :t])), 0
    s = int(math.sqrt(2 * context_pairs(batch)))  # s^2 / 2 pairs, as many as the pack's context
    if name == "causal":
        causal = create_block_mask(lambda b, h, q, k: q >= k, None, None, s, s, device=device)
        fn = torch.compile(flex_attention)
        options = KERNEL_OPTIONS["m64n128"]
        return (lambda q, k, v: fn(q, k, v, block_mask=causal, enable_gqa=True, kernel_options=options)), s
    if name == "flash":
        return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)), s
    raise SystemExit(f"unknown variant {name!r}")


def timed(fn: Callable[[], None], iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def measure(
    attend: Attend, queries: int, keys: int, iters: int, device: torch.device
) -> tuple[float, float, float]:
    """ms forward, ms forward + backward, s to the first forward + backward (compiles)."""
    gen = torch.Generator(device=device).manual_seed(0)

    def tensor(heads: int, length: int) -> torch.Tensor:
        x = torch.randn(1, heads, length, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
        return x.requires_grad_()

    q, k, v = tensor(HEADS, queries), tensor(KV_HEADS, keys), tensor(KV_HEADS, keys)
    start = time.perf_counter()
    out = attend(q, k, v)
    out.float().square().sum().backward()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - start
    grad = torch.randn_like(out)

    def forward() -> None:
        with torch.no_grad():
            attend(q, k, v)

    def both() -> None:
        attend(q, k, v).backward(grad)

    return timed(forward, iters), timed(both, iters), compile_s


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=int, default=8192)
    p.add_argument("--lengths", default="256,384")
    p.add_argument(
        "--variants", default="joint-default,joint,split-default,split,ctx,ctx-m64n128,causal,flash"
    )
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    device = torch.device("cuda")
    low, high = (int(x) for x in args.lengths.split(","))
    batch = make_pack(args.budget, low, high, seed=0)
    pairs = context_pairs(batch)
    m, t = batch.num_blocks * BLOCK, batch.num_context_tokens
    print(f"pack: T = {t}, N = {batch.num_blocks} blocks, M = {m} queries, {pairs / 1e6:.1f}M context pairs")
    batch = batch.to(device)
    print(
        f"{'variant':<14}{'fwd ms':>9}{'fwd+bwd ms':>12}{'fwd TFLOP/s':>13}{'f+b TFLOP/s':>13}{'compile s':>11}"
    )
    print(f"tile density: joint {FlexMask.from_batch(batch).tile_density():.3f}, context only "
          f"{FlexMask.from_batch(batch, split=True).tile_density():.3f}")  # fmt: skip
    for name in args.variants.split(","):
        attend, keys = variant(batch, name, device)
        queries, n_keys = (keys, keys) if keys else (m, t + m)
        try:
            fwd, fb, compile_s = measure(attend, queries, n_keys, args.iters, device)
        except Exception as exc:  # one variant failing must not hide the others
            print(f"{name:<14}FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
            continue
        flop = 4 * pairs * HEADS * HEAD_DIM
        print(
            f"{name:<14}{fwd:9.3f}{fb:12.3f}{flop / fwd / 1e9:13.1f}{3.5 * flop / fb / 1e9:13.1f}{compile_s:11.1f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
