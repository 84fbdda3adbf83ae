"""q4/q6 codecs: the decode formula bit for bit, error bounds, tight scales, batch = per-row, hostile frames."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from common.dispatch import dispatched_ops
from common.synth import llm_like_layers, relative_error
from dflash.shards import CorruptFrame, codec_from_dict, get_codec
from dflash.shards.codecs import zstd_compress
from dflash.shards.qcodec import (
    _STAT_TOKENS,
    GROUP,
    RATIO,
    QBlock,
    _ratio_codes,
    _stat_tokens,
    channel_multipliers,
    dequantize_q,
    quantize_layers,
    quantize_q,
)
from hypothesis import given, settings
from hypothesis import strategies as st

LEVELS = {"q4": 7, "q6": 31}
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _data(kind: str, s: int, h: int, seed: int) -> torch.Tensor:
    if kind == "llm":
        return llm_like_layers(s, h, 3, seed=seed)[seed % 3]
    if kind == "gauss":
        return torch.randn(s, h, generator=torch.Generator().manual_seed(seed)).bfloat16()
    if kind == "sparse":  # exact zeros, whole zero tokens and channels
        x = torch.randn(s, h, generator=torch.Generator().manual_seed(seed))
        x[x.abs() < 1] = 0
        x[::3] = 0
        return x.bfloat16()
    return torch.zeros(s, h, dtype=torch.bfloat16)


def _spec_decode(block: QBlock) -> torch.Tensor:
    """FORMAT.md's decode written independently: the exact product in float64, one rounding to float32,
    then round to nearest even into bfloat16."""
    c = block.codes.double().numpy()
    u = block.group_scales.long().numpy()
    v = block.channel_scales.long().numpy()
    ratio = (32 - (u & 15)) * np.exp2(-(5.0 + (u >> 4)))
    mult = (8 + (v & 7)) * np.exp2((v >> 3) - 3.0)
    exact = c * np.repeat(ratio, GROUP, axis=1)[:, : c.shape[1]] * mult[None, :]
    f32 = (exact * block.token_scales.double().numpy()[:, None]).astype(np.float32)
    return torch.from_numpy(f32).to(torch.bfloat16)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(LEVELS)),
    s=st.integers(1, 40),
    h=st.integers(1, 130),
    kind=st.sampled_from(["llm", "gauss", "sparse", "zeros"]),
    seed=st.integers(0, 2**31),
)
def test_round_trip_matches_the_spec_and_stays_within_half_a_step(
    name: str, s: int, h: int, kind: str, seed: int
) -> None:
    codec = get_codec(name)
    x = _data(kind, s, h, seed)
    frame = codec.encode(x)
    block = codec.decode_block(frame, (s, h))
    y = codec.decode(frame, (s, h), "bfloat16")
    assert y.dtype == torch.bfloat16 and y.shape == (s, h)
    assert torch.equal(y.view(torch.int16), _spec_decode(block).view(torch.int16))
    assert int(block.codes.abs().max()) <= LEVELS[name]
    # every element within half its step (no clipping), plus the bf16 rounding of the result
    step = (
        RATIO[block.group_scales.long()].repeat_interleave(GROUP, 1)[:, :h]
        * channel_multipliers(block.channel_scales)
        * block.token_scales[:, None]
    )
    err = (y.double() - x.double()).abs()
    assert bool((err <= 0.5 * step.double() * (1 + 1e-5) + y.double().abs() * 2**-8 + 1e-30).all())
    # encoding is deterministic and the frame decodes in one piece
    assert codec.encode(x) == frame


@settings(max_examples=40, deadline=None)
@given(s=st.integers(1, 30), h=st.integers(1, 100), seed=st.integers(0, 2**31))
def test_group_scales_are_tight(s: int, h: int, seed: int) -> None:
    """ratio(u) is the smallest ratio >= the group's share of the token's max: a step at most 1/16 above
    what the group needs (unless the group is below the smallest ratio)."""
    x = _data("llm", s, h, seed).float()
    _, groups, _, channel = quantize_q(x, 7)
    y = x / channel_multipliers(channel[0])
    pad = torch.nn.functional.pad(y, (0, groups.shape[1] * GROUP - h)).view(s, -1, GROUP)
    gmax = pad.abs().amax(2)
    top = gmax.amax(1, keepdim=True)
    rho = gmax / torch.where(top > 0, top, torch.ones_like(top))
    ratio = RATIO[groups.long()]
    assert bool((ratio >= rho * (1 - 1e-6)).all())
    above = rho >= RATIO[-1]
    assert bool((ratio[above] <= rho[above] * 17 / 16 * (1 + 1e-6)).all())


@pytest.mark.parametrize("search", [False, True])  # the CPU's estimate, the GPU's binary search
def test_ratio_codes_agree_with_a_search_over_the_table(search: bool) -> None:
    rho = torch.cat(
        [RATIO, RATIO * (1 + 2**-20), RATIO * (1 - 2**-20), torch.rand(4000), torch.tensor([0.0, 1.0])]
    )
    rho = rho.clamp(0, 1).view(45, 106)  # the quantizer's [tokens, groups]
    got = _ratio_codes(rho, RATIO, search=search).flatten()
    rho = rho.flatten()
    want = (RATIO[None, :] >= rho[:, None]).sum(1) - 1  # RATIO decreases: the last u that is >= rho
    assert torch.equal(got, want)
    assert bool((RATIO[1:] < RATIO[:-1]).all()) and RATIO[0] == 1.0


def test_error_and_size_on_llm_like_states_at_a_realistic_width() -> None:
    """q4 is the <= 10 KB/token tier (5 layers x 4096: ratio >= 4.1), q6 smaller than fp8 at lower error."""
    xs = llm_like_layers(512, 4096, 2, seed=7)
    raw = sum(x.numel() * 2 for x in xs)
    for name, min_ratio, max_err in (("q4", 4.1, 0.11), ("q6", 2.6, 0.026)):
        codec = get_codec(name)
        frames = [codec.encode(x) for x in xs]
        assert raw / sum(len(f) for f in frames) >= min_ratio, name
        for x, f in zip(xs, frames, strict=True):
            assert relative_error(codec.decode(f, tuple(x.shape), "bfloat16"), x) <= max_err, name


@pytest.mark.parametrize("together", [False, True])  # a CPU's layer at a time, a GPU's one call
def test_batch_quantization_equals_per_row_encoding(together: bool) -> None:
    """The extractor quantizes a whole batch (rows back to back) on the GPU; each row's frame must be the
    frame the codec writes for that row alone (channel scales are per row, per layer)."""
    codec = get_codec("q4")
    lengths = [5, 700, 1, 33]
    layers = torch.stack(llm_like_layers(sum(lengths), 70, 3, seed=3))
    layers[1] *= 40  # layers of other sizes must not share statistics
    parts = quantize_layers(layers, codec.levels, lengths, together)
    offset = 0
    for i, n in enumerate(lengths):
        blocks = codec.batch_sample(parts, lengths, i, offset)
        for k, block in enumerate(blocks):
            assert codec.encode(block) == codec.encode(layers[k, offset : offset + n])
        offset += n


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 3000), min_size=1, max_size=12))
def test_channel_statistics_read_evenly_spaced_tokens_of_each_row(lengths: list[int]) -> None:
    """Row r's statistics read every ceil(len / 512)th of its own tokens from its first: at most 512."""
    idx, row = _stat_tokens(lengths, sum(lengths))
    start = 0
    for r, n in enumerate(lengths):
        want = np.arange(start, start + n, max(1, -(-n // _STAT_TOKENS)))
        assert np.array_equal(idx[row == r], want) and want.size <= _STAT_TOKENS
        start += n
    assert idx.dtype == row.dtype == np.int64 and np.all(np.diff(row) >= 0)


def test_a_gpus_launches_per_batch_do_not_grow_with_the_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU every operation is a kernel launch, each a GIL hand-off beside the encode threads: the
    quantizer's launches for a batch of 6 layers are those of 1 (at 16M elements a step and a layer at a time,
    the quality bench's q4 extraction spent 4x fp8's GPU time)."""
    import dflash.shards.qcodec as qcodec

    monkeypatch.setattr(qcodec, "_chunk", lambda cpu, device: 10**9)  # every batch below in one step
    lengths = [300, 20, 280]
    x = torch.stack(llm_like_layers(sum(lengths), 64, 6, seed=5))
    one, six = (dispatched_ops(lambda k=k: quantize_layers(x[:k], 7, lengths, together=True)) for k in (1, 6))
    assert one == six
    assert dispatched_ops(lambda: quantize_layers(x, 7, lengths, together=False)) >= 5 * one  # a CPU's way


def test_channel_scales_follow_typical_size_not_massive_tokens() -> None:
    """A channel whose values are 10x larger gets M ~ 10x; one massive token barely moves a channel."""
    x = torch.randn(600, 64, generator=torch.Generator().manual_seed(0))
    x[:, 3] *= 10
    x[0, 5] = 1e4
    mult = channel_multipliers(quantize_q(x, 7)[3][0])
    assert 7 <= float(mult[3] / mult.median()) <= 14
    assert 0.7 <= float(mult[5] / mult.median()) <= 1.5


def test_non_finite_tokens_decode_to_nan_and_leave_others_alone() -> None:
    x = torch.randn(4, 40, generator=torch.Generator().manual_seed(0))
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    codec = get_codec("q4")
    y = codec.decode(codec.encode(x), (4, 40), "bfloat16")
    assert bool(torch.isnan(y[1]).all() and torch.isnan(y[2]).all())
    assert bool(torch.isfinite(y[[0, 3]]).all())
    assert relative_error(y[[0, 3]], x[[0, 3]]) < 0.2  # 80 values: the estimate is noisy


def test_dequantize_with_rows_of_a_packed_batch() -> None:
    """Several samples' codes back to back, each with its own channel scales, decode like each alone."""
    codec = get_codec("q6")
    xs = [llm_like_layers(n, 48, 1, seed=n)[0] for n in (3, 9, 4)]
    blocks = [codec.decode_block(codec.encode(x), tuple(x.shape)) for x in xs]
    packed = QBlock(
        codes=torch.cat([b.codes for b in blocks]),
        group_scales=torch.cat([b.group_scales for b in blocks]),
        token_scales=torch.cat([b.token_scales for b in blocks]),
        channel_scales=torch.stack([b.channel_scales for b in blocks]),
    )
    rows = torch.repeat_interleave(torch.arange(3), torch.tensor([3, 9, 4]))
    want = torch.cat([dequantize_q(b) for b in blocks])
    assert torch.equal(dequantize_q(packed, row_of_token=rows).view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("name", sorted(LEVELS))
def test_registry_and_rejected_inputs(name: str) -> None:
    c = get_codec(name)
    assert codec_from_dict(c.to_dict()) == c and c.to_dict() == {"name": name, "level": 1}
    assert c.device_decode and c.stored_dtype("float32") == "bfloat16"
    with pytest.raises(ValueError, match="Fp8Block"):
        c.encode(get_codec("fp8").decode_block(get_codec("fp8").encode(torch.ones(2, 2)), (2, 2)))
    with pytest.raises(ValueError, match=r"\[N, H\]"):
        c.encode(torch.ones(4))
    with pytest.raises(ValueError, match="malformed QBlock"):
        c.encode(
            QBlock(
                torch.zeros(2, 4, dtype=torch.int8),
                torch.zeros(2, 2, dtype=torch.uint8),
                torch.ones(2),
                torch.zeros(4, dtype=torch.int8),
            )
        )


@settings(max_examples=60, deadline=None)
@given(
    s=st.integers(1, 20),
    h=st.integers(1, 70),
    ds=st.integers(-3, 3),
    dh=st.integers(-3, 3),
    junk=st.binary(max_size=64),
    how=st.sampled_from(["shape", "truncate", "junk", "bomb"]),
)
def test_hostile_frames_raise_corrupt_frame_only(
    s: int, h: int, ds: int, dh: int, junk: bytes, how: str
) -> None:
    """Wrong shapes, truncated frames, junk and frames declaring a huge size: CorruptFrame, never another
    error and never an allocation beyond what the index's shape allows."""
    codec = get_codec("q4")
    frame = codec.encode(torch.randn(s, h))
    shape = (s, h)
    if how == "shape":
        if ds == dh == 0:
            ds = 1
        shape = (max(1, s + ds), max(1, h + dh))
        if codec.decoded_bytes(*shape, "bfloat16") == codec.decoded_bytes(s, h, "bfloat16"):
            return  # the same size, e.g. (8, 1) and (5, 4): every byte is valid, the index's shape decides
    elif how == "truncate":
        frame = frame[: len(frame) // 2]
    elif how == "junk":
        frame = junk
    else:
        frame = zstd_compress(bytes(1 << 20), 1)
    with pytest.raises(CorruptFrame, match="q4 frame"):
        codec.decode(frame, shape, "bfloat16")


def test_short_rows_keep_their_error_bounded() -> None:
    """Channel scales from 2-8 tokens are noisy estimates; pulled to the median they cost little."""
    codec = get_codec("q4")
    for s in (1, 2, 3, 5, 8):
        for seed in range(4):
            x = _data("gauss", s, 256, seed)
            assert relative_error(codec.decode(codec.encode(x), (s, 256), "bfloat16"), x) <= 0.14, (s, seed)


@pytest.mark.parametrize("levels", [7, 31])
def test_results_do_not_depend_on_the_step_size(monkeypatch: pytest.MonkeyPatch, levels: int) -> None:
    """Steps are row ranges and every operation is per row, so the GPU's larger steps give the CPU's bytes."""
    import dflash.shards.qcodec as qcodec

    lengths = [5, 300, 1, 33]
    x = llm_like_layers(sum(lengths), 70, 1, seed=4)[0]
    x[17, 3] = float("nan")
    results = []
    for elements in (100, 10**9):  # one or two rows per step; everything in one step
        monkeypatch.setattr(qcodec, "_chunk", lambda cpu, device, n=elements: n)
        codes, groups, scales, channel = quantize_q(x, levels, lengths)
        rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        decoded = dequantize_q(QBlock(codes, groups, scales, channel), row_of_token=rows)
        results.append((codes, groups, scales, channel, decoded))
    for name, a, b in zip(("codes", "groups", "scales", "channel", "decoded"), *results, strict=True):
        assert torch.equal(torch.isnan(a.float()), torch.isnan(b.float())), name
        assert torch.equal(a.float().nan_to_num(), b.float().nan_to_num()), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["llm", "gauss", "sparse"])
def test_a_gpu_quantizes_and_decodes_to_the_cpus_bits(kind: str) -> None:
    """The extractor quantizes a batch's layers at once on its GPU, `dflash-shards convert` a layer at a time
    on a CPU, and training decodes on the GPU: the same codes, scales and states every way."""
    lengths = [700, 3, 1300, 45]
    x = torch.stack([_data(kind, sum(lengths), 320, seed) for seed in range(3)])
    on_gpu = quantize_layers(x.cuda(), 7, lengths, together=True)
    on_cpu = quantize_layers(x, 7, lengths, together=False)
    for gpu, cpu in zip(on_gpu, on_cpu, strict=True):
        assert torch.equal(gpu.cpu(), cpu)
    codes, groups, scales, channel = on_cpu
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    for k in range(x.shape[0]):
        block = QBlock(codes[k], groups[k], scales[k], channel[k])
        gpu_block = QBlock(*(t.cuda() for t in (codes[k], groups[k], scales[k], channel[k])))
        want = dequantize_q(block, row_of_token=rows)
        assert torch.equal(
            dequantize_q(gpu_block, row_of_token=rows.cuda()).cpu().view(torch.int16), want.view(torch.int16)
        )
