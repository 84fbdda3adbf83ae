"""`q4` and `q6`: integer codes with small per-group scales, entropy-coded by zstd (spec: FORMAT.md, "Codecs").

One layer of one sample, [S, H], is stored as

    per channel h   a multiplier code v[h] (int8): M(v), 4 significant bits, equalizes channel sizes
    per token t     a float32 scale T[t] (the token's absmax / L after equalizing)
    per group j     a ratio code u[t, j] (uint8): ratio(u) <= 1 of the token's scale, 32 channels a group
    per element     a code c in [-L, L], one byte each      L = 7 (q4) or 31 (q6)

and decodes to bfloat16(float32(c * ratio(u) * M(v)) * T). Why this shape (bench/bench_codecs.py, LLM-like
states whose channel sizes spread log-normally, q4 at ~9.6 KB/token for 5 x 4096): without channel
multipliers a small channel sharing a group with a large one rounds to ~0 (typical-channel error 23%);
power-of-two multipliers leave 12%, 1/8-step ones 10%. Per-group scales keep an outlier from coarsening
more than its own 32 channels. Codes take one byte each and zstd's Huffman stage does the entropy coding
(q4 codes carry ~3.6 bits: packing nibbles first saves nothing after zstd and would tie the layout to 4
bits). `c * ratio(u) * M(v)` is exact in float32 (<= 16 significant bits), so the only roundings are one
float32 multiply and the bfloat16 cast: the GPU decode in training (plain torch ops, `dequantize_q`) and
the CPU decode give the same bits.

`quantize_q` runs on any device: the extractor quantizes on the GPU (codes and scales are ~half the bf16
bytes to copy to the host) and the converter wherever it runs. Both must write the same codes, so a division
by a constant is `divide_exactly` and no rounding reads a transcendental function's last bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from .codec_base import Codec, count_nonfinite, divide_exactly, zstd_decompress_exact, zstd_frame_of
from .codecs import register_codec
from .fp8 import Fp8Block

GROUP = 32  # channels per group scale
# Elements per step. On a CPU, the best measured on one core (larger fresh temporaries cost more in page
# faults than the math). On a GPU each step is ~30 kernel launches, and each launch hands the GIL to the
# extractor's encode threads and may wait to get it back: at the CPU's sizes a Qwen3-8B batch of q4 took
# ~8,000 launches per layer set and extraction ran at 0.61x the bare forward, and at 16M elements a step
# the quality bench's small target still spent 4x fp8's GPU time in its forward stage (BENCHMARKS.md). So a
# GPU's steps are 64x the CPU's: quantizing, 64M elements (two 256 MiB float32 temporaries); decoding, 16M.
_QUANT_CHUNK = 1 << 20
_DEQUANT_CHUNK = 1 << 18
_GPU_STEP_SCALE = 64


def _chunk(cpu_elements: int, device: torch.device) -> int:
    return cpu_elements if device.type == "cpu" else cpu_elements * _GPU_STEP_SCALE


def _ratio_table() -> torch.Tensor:
    """ratio(u) = (32 - (u & 15)) * 2^-(5 + (u >> 4)): 1, 31/32, ..., 17/32, 1/2, ... down to 17 * 2^-20.

    Decreasing in u, steps of at most 1/16 within an octave; every value has <= 5 significant bits, so
    code * ratio is exact in float32."""
    u = torch.arange(256, dtype=torch.int64)
    return ((32 - (u & 15)).double() * torch.pow(2.0, -(5 + (u >> 4)).double())).float()


RATIO = _ratio_table()
# log2(1 + (k + 1/2) / 8): where 2^frac passes the midpoint between mantissa steps k and k + 1 (channel codes)
_MANTISSA_EDGES = torch.tensor([math.log2(1 + (k + 0.5) / 8) for k in range(8)], dtype=torch.float32)
_TABLES = {"ratio": RATIO, "ratio ascending": RATIO.flip(0).contiguous(), "mantissa edges": _MANTISSA_EDGES}
_tables_on: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table_on(name: str, device: torch.device) -> torch.Tensor:
    """One of the codec's constant tables, copied to `device` once."""
    if (name, device) not in _tables_on:
        _tables_on[name, device] = _TABLES[name].to(device)
    return _tables_on[name, device]


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2^k as float32, built from the exponent bits (exact for k in [-126, 127] on every device)."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def channel_multipliers(v: torch.Tensor) -> torch.Tensor:
    """M(v) = (8 + (v & 7)) * 2^((v >> 3) - 3) for int8 codes v: 2^-16 .. 1.875 * 2^15 in steps of at most
    1/8 (exact in float32: 4 significant bits)."""
    v = v.to(torch.int32)
    return (8 + (v & 7)).float() * _pow2((v >> 3) - 3)


@dataclass(slots=True)
class QBlock:
    """One layer of one sample in q codes: `codes` int8 [S, H] (c), `group_scales` uint8 [S, ceil(H/32)]
    (ratio codes u), `token_scales` float32 [S] (T), `channel_scales` int8 [H] (multiplier codes v)."""

    codes: torch.Tensor
    group_scales: torch.Tensor
    token_scales: torch.Tensor
    channel_scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))


_SHRINK = 4.0  # pseudo-tokens pulling a row's channel scales to its median: short rows estimate them badly
_STAT_TOKENS = 512  # tokens per row the channel statistics read (evenly spaced): plenty for a mean of logs


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on `device` without a host sync: a pageable copy would wait for the GPU's queue
    (the extractor's forward) to drain before the next batch could be queued."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _stat_tokens(lengths: Sequence[int] | None, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(token index, row id) of up to _STAT_TOKENS evenly spaced tokens of each row (every ceil(len / 512)th
    from the row's first); whole-array numpy, as a batch may hold thousands of rows (rows x layers on a GPU)."""
    size = np.asarray([n] if lengths is None else lengths, dtype=np.int64)
    stride = np.maximum(1, -(-size // _STAT_TOKENS))
    count = -(-size // stride)  # 0 for an empty row
    row = np.repeat(np.arange(size.size, dtype=np.int64), count)
    first = np.cumsum(count) - count  # each row's first pick among all picks
    at = np.arange(row.size, dtype=np.int64) - first[row]
    idx = (np.cumsum(size) - size)[row] + at * stride[row]
    return idx, row


def channel_scale_codes(x: torch.Tensor, lengths: Sequence[int] | None = None) -> torch.Tensor:
    """int8 [R, H]: per row (tokens of `lengths` back to back; None: one row) and channel, the code v whose
    M(v) is nearest the channel's typical size over the row's median channel.

    Typical size = 2^(mean of floor(log2|x|)) over the channel's finite nonzero values among up to 512
    evenly spaced tokens of the row (read from the exponent bits: no logarithms), pulled towards the median
    as if 4 more tokens sat there (measured: 2-8 token rows got 20-33% error from noisy estimates, longer
    rows are unaffected). A mean of logs, not an RMS: a few massive tokens must not shrink a channel's
    ordinary values into its group's rounding noise."""
    n, h = x.shape
    rows = 1 if lengths is None else len(lengths)
    idx, row = (_to_device(a, x.device) for a in _stat_tokens(lengths, n))
    # floor(log2|x|) + 127 from the exponent field of bfloat16 bits (int16 shifts are the fast ones on a CPU)
    e = (x.index_select(0, idx).to(torch.bfloat16).view(torch.int16) >> 7) & 0xFF
    seen = ((e > 0) & (e < 0xFF)).float()  # 0: zero or subnormal, 255: inf or NaN; both left out
    total = torch.zeros((rows, h), dtype=torch.float32, device=x.device).index_add_(0, row, e.float() * seen)
    count = torch.zeros((rows, h), dtype=torch.float32, device=x.device).index_add_(0, row, seen)
    mean = torch.where(count > 0, total / count.clamp_min(1), torch.full_like(total, float("nan")))
    centre = torch.nan_to_num(mean.nanmedian(dim=1).values, nan=0.0)
    t = torch.nan_to_num((mean - centre[:, None]) * (count / (count + _SHRINK)), nan=0.0).clamp_(-16.0, 15.9)
    octave = t.floor()
    # The mantissa step f (of 1/8) whose 1 + f / 8 is nearest 2^(t - octave): the midpoints it passes, compared
    # in the log domain (exp2 may differ by an ulp between devices and move a channel on a midpoint); 8
    # rolls over to the next octave.
    f = torch.bucketize(t - octave, _table_on("mantissa edges", x.device), right=True)
    return (octave * 8 + f).clamp_(-128, 127).to(torch.int8)


def _ratio_codes(rho: torch.Tensor, ratio: torch.Tensor, search: bool | None = None) -> torch.Tensor:
    """The largest u with ratio(u) >= rho (255 if none), for rho in [0, 1]: no value needs a code beyond L.

    On a GPU (or `search`), a binary search of the table: two kernels. On a CPU, where a table search costs
    ~70 ns per element, estimated from log2, then moved by one where rounding put it on the wrong side
    (~25 passes, each cheap there). Both give the same codes (tests)."""
    if search if search is not None else rho.device.type != "cpu":
        # the first ratio >= rho in the ascending table, counted from the top
        return 255 - torch.searchsorted(_table_on("ratio ascending", rho.device), rho.contiguous())
    octave = torch.log2(rho).neg_().floor_().clamp_(0, 16)
    u = (octave * 16 + (32 - 32 * rho * torch.exp2(octave)).floor_().clamp_(0, 15)).clamp_(0, 255).long()
    u -= (ratio[u] < rho).long()
    u.clamp_(0, 255)
    u += ((u < 255) & (ratio[(u + 1).clamp_(max=255)] >= rho)).long()
    return u


def quantize_q(
    x: torch.Tensor, levels: int, lengths: Sequence[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize [N, H] (rows of `lengths` back to back, each with its own channel scales) on x's device.

    Returns codes int8 [N, H], group ratio codes uint8 [N, ceil(H/32)], token scales float32 [N] and channel
    scale codes int8 [R, H]. A token holding a non-finite value gets scale NaN (codes 0): it decodes to NaN.
    Works in row chunks through reused buffers: fresh full-size temporaries cost more in page faults than
    the arithmetic on a CPU, and bound the GPU's temporaries whatever the batch."""
    if x.ndim != 2:
        raise ValueError(f"quantize_q expects [N, H], got shape {tuple(x.shape)}")
    n, h = x.shape
    if lengths is not None and sum(lengths) != n:
        raise ValueError(f"row lengths add up to {sum(lengths)}, not the {n} tokens given")
    groups = -(-h // GROUP)
    dev = x.device
    codes = torch.empty((n, h), dtype=torch.int8, device=dev)
    group_codes = torch.empty((n, groups), dtype=torch.uint8, device=dev)
    token_scales = torch.ones(n, dtype=torch.float32, device=dev)
    if n == 0 or h == 0:
        return (
            codes,
            group_codes,
            token_scales,
            torch.zeros((1 if lengths is None else len(lengths), h), dtype=torch.int8, device=dev),
        )
    channel = channel_scale_codes(x, lengths)
    ratio = _table_on("ratio", dev)
    inv = 1.0 / channel_multipliers(channel)
    if lengths is not None and len(lengths) > 1:  # each token's row's channel factors
        seg = _to_device(np.repeat(np.arange(len(lengths)), lengths), dev)
    else:
        seg = None
    step = max(1, _chunk(_QUANT_CHUNK, dev) // (groups * GROUP))
    # Past column h the buffer is zero in every step: a group's padding never sets its maximum.
    buf = torch.zeros((min(step, n), groups * GROUP), dtype=torch.float32, device=dev)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        y = buf[: r1 - r0]
        y[:, :h].copy_(x[r0:r1]).mul_(inv if seg is None else inv[seg[r0:r1]])
        yg = y.view(r1 - r0, groups, GROUP)
        # max(amax, -amin): no |y| temporary; NaN propagates
        gmax = torch.maximum(yg.amax(dim=2), yg.amin(dim=2).neg_())
        tmax = gmax.amax(dim=1)
        finite = torch.isfinite(tmax)
        safe = torch.where(finite & (tmax > 0), tmax, torch.ones_like(tmax))
        scale = torch.where(finite, divide_exactly(safe, levels), torch.full_like(tmax, float("nan")))
        rho = torch.nan_to_num(gmax / safe[:, None], nan=1.0).clamp_(0.0, 1.0)
        u = _ratio_codes(rho, ratio)
        yg.div_((ratio[u] * scale[:, None])[:, :, None]).round_().clamp_(-levels, levels)
        # The whole buffer, padding columns included: a non-finite token's NaN scale must not reach the next step.
        codes[r0:r1] = torch.nan_to_num_(y, nan=0.0)[:, :h]
        group_codes[r0:r1] = u
        token_scales[r0:r1] = scale
    return codes, group_codes, token_scales, channel


def quantize_layers(
    packed: torch.Tensor, levels: int, lengths: Sequence[int], together: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_q` of each layer of [K, N, H], stacked: codes [K, N, H], ratio codes [K, N, G], token
    scales [K, N], channel scale codes [K, R, H].

    `together` quantizes all layers in one call, layer k's row r as row k * R + r of the flattened batch
    (statistics are per row, so the codes are the same): a GPU's launches then do not grow with the layers.
    A CPU goes a layer at a time: there a whole batch's fresh temporaries cost more than the calls."""
    k, n, h = packed.shape
    if together:
        codes, groups, scales, channel = quantize_q(packed.reshape(k * n, h), levels, list(lengths) * k)
        return (
            codes.view(k, n, h),
            groups.view(k, n, groups.shape[1]),
            scales.view(k, n),
            channel.view(k, len(lengths), h),
        )
    per_layer = [quantize_q(layer, levels, lengths) for layer in packed]
    codes, groups, scales, channel = (torch.stack(parts) for parts in zip(*per_layer, strict=True))
    return codes, groups, scales, channel


def dequantize_q(
    block: QBlock, dtype: torch.dtype = torch.bfloat16, row_of_token: torch.Tensor | None = None
) -> torch.Tensor:
    """bfloat16(float32(c * ratio(u) * M(v)) * T) on the block's device, in plain torch ops.

    `channel_scales` is [H], or [R, H] with `row_of_token` [S] naming each token's row (the layers of a
    packed batch of several samples: train.blocks.PackedBatch)."""
    codes, groups, scales = block.codes, block.group_scales, block.token_scales
    s, h = codes.shape
    out = torch.empty((s, h), dtype=dtype, device=codes.device)
    if out.numel() == 0:
        return out
    ratio = _table_on("ratio", codes.device)
    ng = groups.shape[1]
    channel = channel_multipliers(block.channel_scales)
    step = max(1, _chunk(_DEQUANT_CHUNK, codes.device) // h)
    for r0 in range(0, s, step):
        r1 = min(s, r0 + step)
        v = codes[r0:r1].float()  # a fresh contiguous tensor
        g = ratio[groups[r0:r1].long()]
        if h == ng * GROUP:
            v.view(r1 - r0, ng, GROUP).mul_(g[:, :, None])
        else:
            v.mul_(g.repeat_interleave(GROUP, dim=1)[:, :h])
        v.mul_(channel if row_of_token is None else channel[row_of_token[r0:r1]])  # exact so far
        v.mul_(scales[r0:r1, None])  # the one float32 rounding
        out[r0:r1] = v
    return out


class QCodec(Codec):
    """frame = zstd(T f32 LE [S] || v i8 [H] || u u8 [S * ceil(H/32)] || c i8 [S * H])."""

    levels: ClassVar[int]
    device_decode = True

    def stored_dtype(self, input_dtype: str) -> str:
        return "bfloat16"

    def decoded_bytes(self, tokens: int, hidden: int, dtype: str) -> int:
        return tokens * (4 + -(-hidden // GROUP) + hidden) + hidden

    def quantize_batch(self, packed: torch.Tensor, lengths: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """[K, N, H] layers of rows of `lengths` back to back -> codes, ratio codes, token scales [K, N, ...]
        and channel scale codes [K, R, H], on packed's device (the extractor calls this on the GPU)."""
        return quantize_layers(packed, self.levels, lengths, together=packed.device.type != "cpu")

    def batch_sample(
        self, parts: tuple[torch.Tensor, ...], lengths: Sequence[int], i: int, offset: int
    ) -> list[QBlock]:
        codes, groups, scales, channel = parts
        rows = slice(offset, offset + int(lengths[i]))
        return [
            QBlock(codes[k, rows], groups[k, rows], scales[k, rows], channel[k, i])
            for k in range(codes.shape[0])
        ]

    def encode(self, x: torch.Tensor | np.ndarray | Fp8Block | QBlock) -> bytes:
        if isinstance(x, Fp8Block):
            raise ValueError(f"codec {self.name!r} cannot store an Fp8Block; pass the bf16 tensor")
        if not isinstance(x, QBlock):
            t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))
            codes, groups, scales, channel = quantize_q(t, self.levels)
            x = QBlock(codes, groups, scales, channel[0])
        s, h = x.shape
        if (
            x.codes.dtype != torch.int8
            or x.group_scales.dtype != torch.uint8
            or x.channel_scales.dtype != torch.int8
            or tuple(x.group_scales.shape) != (s, -(-h // GROUP))
            or tuple(x.token_scales.shape) != (s,)
            or tuple(x.channel_scales.shape) != (h,)
        ):
            raise ValueError(
                f"malformed QBlock: codes {x.codes.dtype} {tuple(x.codes.shape)}, group scales "
                f"{x.group_scales.dtype} {tuple(x.group_scales.shape)}, token scales "
                f"{tuple(x.token_scales.shape)}, channel scales {x.channel_scales.dtype} "
                f"{tuple(x.channel_scales.shape)}"
            )
        parts = [x.token_scales.float(), x.channel_scales, x.group_scales, x.codes]
        return zstd_frame_of(parts, self.level)

    def decode_block(
        self, buf: bytes | memoryview, shape: tuple[int, int], rows: int | None = None
    ) -> QBlock:
        """The stored codes and scales of the first `rows` tokens (default all), undecoded (training decodes
        them on its GPU); the codes come last, so the other tokens' codes are never decompressed. Every
        byte value is valid in every part, so nothing but the size can be wrong."""
        s, h = shape
        m = s if rows is None else min(rows, s)
        groups = -(-h // GROUP)
        at = 4 * s + h  # where the group scales start
        codes_at = at + s * groups
        raw = zstd_decompress_exact(
            buf, self.decoded_bytes(s, h, "bfloat16"), f"{self.name} frame", keep=codes_at + m * h
        )
        whole = torch.frombuffer(bytearray(raw), dtype=torch.uint8)  # one writable copy; parts are views
        return QBlock(
            codes=whole[codes_at : codes_at + m * h].view(torch.int8).view(m, h),
            group_scales=whole[at : at + m * groups].view(m, groups),
            token_scales=torch.from_numpy(np.frombuffer(raw, dtype="<f4", count=m).astype(np.float32)),
            channel_scales=whole[4 * s : at].view(torch.int8),
        )

    def decode(
        self, buf: bytes | memoryview, shape: tuple[int, int], dtype: str | torch.dtype
    ) -> torch.Tensor:
        return dequantize_q(self.decode_block(buf, shape))

    def decode_rows(
        self, buf: bytes | memoryview, shape: tuple[int, int], dtype: str | torch.dtype, rows: int
    ) -> torch.Tensor:
        return dequantize_q(self.decode_block(buf, shape, rows))

    def nonfinite(self, buf: bytes | memoryview, shape: tuple[int, int], dtype: str | torch.dtype) -> int:
        # A value is bf16(float32(c * ratio(u) * M(v)) * T) with |c * ratio(u) * M(v)| <= L * max M: it is
        # NaN/inf when its token's scale T is (then all H values are), or when L * max M * |T| may overflow.
        # Only such tokens (none from a finite input) are dequantized, so `verify` never decodes the rest.
        block = self.decode_block(buf, shape)
        scales = block.token_scales
        bad = ~torch.isfinite(scales)
        bound = self.levels * float(channel_multipliers(block.channel_scales).max()) if shape[1] else 0.0
        risky = (~bad & (scales.abs() * bound >= 2.0**127)).nonzero().flatten()
        n = int(bad.sum()) * shape[1]
        if risky.numel():
            sub = QBlock(block.codes[risky], block.group_scales[risky], scales[risky], block.channel_scales)
            n += count_nonfinite(dequantize_q(sub))
        return n


class Q6Codec(QCodec):
    name = "q6"
    levels = 31


class Q4Codec(QCodec):
    name = "q4"
    levels = 7


register_codec(Q6Codec)
register_codec(Q4Codec)
