"""Codecs: bit-exact lossless round trips, fp8 accuracy on heavy-tailed data, hostile frames rejected."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from common.synth import llm_like_layers, relative_error
from dflash.shards import CorruptFrame, Fp8Block, codec_from_dict, get_codec, quantize_fp8
from dflash.shards.codecs import dequantize_fp8, zstd_compress
from dflash.shards.fp8 import _dequantize_fp8_cpu
from hypothesis import given, settings
from hypothesis import strategies as st

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _random_bits(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every bit pattern is fair game (NaN payloads, -0, inf, subnormals): lossless means bits."""
    rng = np.random.default_rng(seed)
    if dtype == torch.float32:
        return torch.from_numpy(rng.integers(0, 2**32, size=shape, dtype=np.uint32).view(np.int32)).view(
            dtype
        )
    return torch.from_numpy(rng.integers(0, 2**16, size=shape, dtype=np.uint16).view(np.int16)).view(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@settings(max_examples=60, deadline=None)
@given(
    s=st.integers(1, 70),
    h=st.integers(1, 70),
    dtype=st.sampled_from(sorted(DTYPES)),
    kind=st.sampled_from(["bits", "llm", "zeros"]),
    seed=st.integers(0, 2**31),
)
def test_lossless_round_trip_is_bit_exact(s: int, h: int, dtype: str, kind: str, seed: int) -> None:
    codec = get_codec("lossless")
    if kind == "bits":
        x = _random_bits((s, h), DTYPES[dtype], seed)
    elif kind == "llm":
        x = llm_like_layers(s, h, 1, seed=seed, dtype=DTYPES[dtype])[0]
    else:
        x = torch.zeros(s, h, dtype=DTYPES[dtype])
    frame = codec.encode(x)
    y = codec.decode(frame, (s, h), dtype)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert torch.equal(_bits(y), _bits(x))
    # numpy input (fp16/fp32 only: numpy has no bf16) gives the very same frame
    if dtype != "bfloat16":
        assert codec.encode(x.numpy()) == frame


@pytest.mark.parametrize("probe", [True, False])
def test_lossless_multi_chunk_planes_round_trip(monkeypatch: pytest.MonkeyPatch, probe: bool) -> None:
    """Planes longer than one encode step, compressible or not, with and without the raw probe."""
    from dflash.shards.codecs import LosslessCodec

    monkeypatch.setattr(LosslessCodec, "probe", probe)
    codec = get_codec("lossless")
    for x in (
        llm_like_layers(1100, 300, 1, seed=2, dtype=torch.float32)[0],
        _random_bits((700, 500), torch.float32, 3),
    ):
        frame = codec.encode(x)
        lengths = struct.unpack_from("<4I", frame)
        assert sum(lengths) + 16 == len(frame) and all(0 < n <= x.numel() for n in lengths)
        assert torch.equal(_bits(codec.decode(frame, tuple(x.shape), "float32")), _bits(x))


def test_lossless_big_layer_stores_noise_plane_raw_and_compresses_target_ratio() -> None:
    x = llm_like_layers(512, 1024, 1, seed=1)[0]
    frame = get_codec("lossless").encode(x)
    lengths = struct.unpack_from("<2I", frame)
    assert lengths[0] == x.numel()  # low bf16 byte: raw
    assert lengths[1] < x.numel() * 0.6  # high byte: sign + exponent compress well
    assert x.numel() * 2 / len(frame) >= 1.38


@settings(max_examples=40, deadline=None)
@given(s=st.integers(1, 64), h=st.integers(1, 300), seed=st.integers(0, 2**31), layer=st.integers(0, 4))
def test_fp8_relative_error_on_heavy_tailed_data(s: int, h: int, seed: int, layer: int) -> None:
    x = llm_like_layers(s, h, layer + 1, seed=seed)[layer]
    codec = get_codec("fp8")
    y = codec.decode(codec.encode(quantize_fp8(x)), (s, h), "bfloat16")
    assert y.dtype == torch.bfloat16 and y.shape == (s, h)
    # The hard bound for any size: e4m3 rounds each normal value within half an ulp (2^-4 relative) and the
    # bf16 result within 2^-9, so (1 + 2^-4)(1 + 2^-9) - 1 plus fp32 slack; subnormals are tiny next to each
    # row's max. The 3% figure is statistical and holds for realistic widths (below): a 49-value row has
    # reached 3.1%.
    assert relative_error(y, x) <= 0.0665
    # encoding a raw tensor quantizes on the fly to the same frame
    assert codec.encode(x) == codec.encode(quantize_fp8(x))


def test_fp8_relative_error_on_realistic_widths() -> None:
    codec = get_codec("fp8")
    for seed, (s, h) in enumerate([(64, 1024), (16, 4096), (256, 2048)]):
        for x in llm_like_layers(s, h, 5, seed=seed):
            y = codec.decode(codec.encode(quantize_fp8(x)), (s, h), "bfloat16")
            assert relative_error(y, x) <= 0.03


def test_fp8_ratio_on_llm_like_data() -> None:
    xs = llm_like_layers(256, 1024, 3, seed=3)
    codec = get_codec("fp8")
    stored = sum(len(codec.encode(quantize_fp8(x))) for x in xs)
    assert sum(x.numel() * 2 for x in xs) / stored >= 2.2


def test_fp8_fast_cpu_dequantize_matches_torch_bit_for_bit() -> None:
    q = torch.arange(256, dtype=torch.uint8).repeat(7, 1)  # every e4m3fn code incl. subnormals, -0, NaN
    scale = torch.tensor([1.0, 1e-30, 3e4, 0.5, 1e30, 2.0**-20, 7.25])
    fast = _dequantize_fp8_cpu(q.numpy(), scale.numpy())
    ref = dequantize_fp8(Fp8Block(q=q, scale=scale))
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(fast), nan)
    assert torch.equal(_bits(fast)[~nan], _bits(ref)[~nan])


def test_fp8_fast_dequantize_across_chunks() -> None:
    rng = np.random.default_rng(4)
    q = torch.from_numpy(rng.integers(0, 256, size=(1100, 300), dtype=np.uint8))  # > 1 chunk of 2^18
    scale = torch.from_numpy(rng.lognormal(0, 3, size=1100).astype(np.float32))
    fast = _dequantize_fp8_cpu(q.numpy(), scale.numpy())
    ref = dequantize_fp8(Fp8Block(q=q, scale=scale))
    nan = torch.isnan(ref)
    assert nan.any() and torch.equal(torch.isnan(fast), nan)
    assert torch.equal(_bits(fast)[~nan], _bits(ref)[~nan])


def test_quantize_fp8_matches_the_spec_formula_across_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import dflash.shards.fp8 as fp8

    x = llm_like_layers(300, 70, 3, seed=8)[2]
    monkeypatch.setattr(fp8, "_QUANT_CHUNK_CPU", 1000)  # 14 rows per step (the CPU path's chunks)
    got = quantize_fp8(x)
    x32 = x.float().clone()
    before = x32.clone()
    quantize_fp8(x32)
    assert torch.equal(x32, before)  # the caller's tensor is never modified
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    q = (xf / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(got.scale, scale) and torch.equal(got.q, q)


def test_quantize_fp8_edge_cases() -> None:
    x = torch.zeros(3, 5, dtype=torch.bfloat16)
    x[1] = torch.tensor([1e-3, -2.0, 448.0, 5e4, 0.0])
    x[2, 0] = float("nan")
    b = quantize_fp8(x)
    assert b.q.dtype == torch.uint8 and b.scale.dtype == torch.float32 and b.shape == (3, 5)
    assert b.scale[0].item() == 1.0  # an all-zero token keeps a harmless scale
    y = dequantize_fp8(b)
    assert torch.equal(y[0], x[0])
    assert torch.allclose(y[1].float(), x[1].float(), rtol=0.07, atol=5e4 / 448 / 8)
    assert torch.isnan(y[2]).any()  # non-finite input stays visible after the round trip
    with pytest.raises(ValueError, match=r"\[S, H\]"):
        quantize_fp8(torch.zeros(4))


@pytest.mark.parametrize("name", ["lossless", "fp8"])
def test_registry_round_trip_and_bad_names(name: str) -> None:
    c = get_codec(name, level=3)
    assert codec_from_dict(c.to_dict()) == c and c.to_dict() == {"name": name, "level": 3}
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec("gzip")
    with pytest.raises(ValueError, match="bad parameters"):
        get_codec(name, shuffle=True)
    with pytest.raises(ValueError, match="level"):
        get_codec(name, level=0)


def test_lossless_rejects_fp8_block_and_odd_dtypes() -> None:
    with pytest.raises(ValueError, match="Fp8Block"):
        get_codec("lossless").encode(quantize_fp8(torch.ones(2, 2)))
    with pytest.raises(ValueError, match="dtype"):
        get_codec("lossless").encode(torch.ones(2, 2, dtype=torch.float64))


def test_corrupt_lossless_frames_raise_clear_errors() -> None:
    codec = get_codec("lossless")
    x = llm_like_layers(300, 256, 1, seed=5)[0]
    frame = codec.encode(x)
    with pytest.raises(CorruptFrame, match="shorter than"):
        codec.decode(frame[:3], (300, 256), "bfloat16")
    with pytest.raises(CorruptFrame, match="do not add up"):
        codec.decode(frame[:-1], (300, 256), "bfloat16")
    with pytest.raises(CorruptFrame):  # a frame for a different shape never decodes to garbage
        codec.decode(frame, (299, 256), "bfloat16")
    # a hostile plane that declares a huge decoded size is refused before any allocation
    bomb = zstd_compress(bytes(1 << 20), 1)
    evil = struct.pack("<2I", len(bomb), len(bomb)) + bomb + bomb
    with pytest.raises(CorruptFrame, match="declares 1048576 bytes"):
        codec.decode(evil, (64, 64), "bfloat16")


def test_corrupt_fp8_frame_raises() -> None:
    codec = get_codec("fp8")
    frame = codec.encode(torch.randn(8, 16))
    with pytest.raises(CorruptFrame, match="fp8 frame"):
        codec.decode(frame, (8, 17), "bfloat16")
    with pytest.raises(CorruptFrame, match="fp8 frame"):
        codec.decode(b"\x00" * 20, (8, 16), "bfloat16")


_PART_DTYPES = {"float32": torch.float32, "uint8": torch.uint8, "int8": torch.int8}


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 40)), min_size=1, max_size=4),
    first_float=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_zstd_frame_of_is_the_parts_little_endian_bytes_in_order(
    shapes: list[tuple[int, int]], first_float: bool, seed: int
) -> None:
    from dflash.shards.codec_base import zstd_decompress_exact, zstd_frame_of

    rng = np.random.default_rng(seed)
    parts = []
    for i, shape in enumerate(shapes):
        name = "float32" if first_float and i == 0 else ("uint8", "int8")[i % 2]
        bits = rng.integers(0, 256, size=(*shape, _PART_DTYPES[name].itemsize), dtype=np.uint8)
        parts.append(torch.from_numpy(bits.view(name).reshape(shape)))
    parts[-1] = parts[-1].t()  # a strided view: the frame holds its values in logical order
    expected = b"".join(
        p.contiguous().numpy().astype("<f4" if p.dtype == torch.float32 else p.numpy().dtype).tobytes()
        for p in parts
    )
    frame = zstd_frame_of(parts)
    assert bytes(zstd_decompress_exact(frame, len(expected), "frame")) == expected


@pytest.mark.parametrize("name", ["fp8", "q4"])
def test_quantized_frames_compress_in_one_call(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """The extractor encodes beside the thread that launches the forward: a streaming compressor takes the
    GIL back for every ~128 KB of output (bench/bench_gil.py), so a quantized frame is one `compress` call."""
    from dflash.shards import codec_base

    calls: list[str] = []

    class Spy:
        def __init__(self, real: object) -> None:
            self.real = real

        def compress(self, data: object) -> bytes:
            calls.append("compress")
            return self.real.compress(data)

        def compressobj(self, *args: object, **kwargs: object) -> object:
            calls.append("compressobj")
            return self.real.compressobj(*args, **kwargs)

    real = codec_base.compressor
    monkeypatch.setattr(codec_base, "compressor", lambda level: Spy(real(level)))
    codec = get_codec(name)
    x = llm_like_layers(300, 512, 1, seed=5)[0]
    block = codec.batch_sample(codec.quantize_batch(x[None], [300]), [300], 0, 0)[0]
    frame = codec.encode(block)
    assert calls == ["compress"]
    monkeypatch.setattr(codec_base, "compressor", real)
    assert torch.equal(
        codec.decode(frame, (300, 512), "bfloat16"), codec.decode(codec.encode(x), (300, 512), "bfloat16")
    )
