"""quantize_fp8's fast paths give the bits of the first implementation (kept below as the reference).

CPU: `_quantize_cpu` (what quantize_fp8 runs there) must match the reference byte for byte, NaN signs
included. The GPU path (`_quantize_eager`) is checked on a CPU for every
non-NaN byte and for where the NaNs are; their NaN bytes can differ there only because torch's CPU
fp16 -> fp32 cast drops a NaN's sign in scalar loop tails, which fall elsewhere in a different sequence of
ops. On CUDA (tests marked `cuda`, skipped without a GPU) the eager path must match the reference
exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from common.fp8_reference import reference_quantize_fp8
from common.synth import llm_like_layers
from dflash.shards import fp8
from dflash.shards.codecs import get_codec, quantize_fp8
from hypothesis import given, settings
from hypothesis import strategies as st

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
KINDS = ["bits", "special", "llm", "zeros", "tiny"]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


SPECIALS = [
    0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1.0, -1.5, 448.0, -448.0, 464.0, 480.0, 2.0**-6,
    2.0**-9, 2.0**-10, 1e-45, 1e-40, 2.0**-126, 2.0**-133, 6e-8, 6.1e-5, 65504.0, -7e4, 3e38, -3.3e38,
]  # fmt: skip


def make_input(kind: str, s: int, h: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Hostile and realistic [s, h] inputs: raw bit patterns (NaNs of both signs with payloads, infs,
    subnormals), special values, LLM-like rows, all zeros (+-0), and rows whose amax is subnormal."""
    rng = np.random.default_rng(seed)
    iview = INT_VIEW[dtype]
    if kind == "bits":
        bits = rng.integers(0, 2 ** (8 * iview.itemsize), size=(s, h), dtype=np.uint64)
        npint = np.int16 if iview == torch.int16 else np.int32
        return torch.from_numpy(bits.astype(npint.__name__.replace("int", "uint")).view(npint)).view(dtype)
    if kind == "special":
        x = torch.tensor(rng.choice(SPECIALS, size=(s, h)), dtype=torch.float64).to(dtype)
        # negative NaNs: the sign bit set on about half of them (a tensor literal would make them positive)
        flip = torch.from_numpy(rng.random((s, h)) < 0.5) & torch.isnan(x)
        x.view(iview)[flip] |= torch.tensor(-1 << (8 * iview.itemsize - 1), dtype=iview)
        return x
    if kind == "llm":
        return llm_like_layers(s, h, 3, seed=seed, dtype=dtype)[int(rng.integers(3))]
    if kind == "zeros":
        x = torch.zeros(s, h, dtype=dtype)
        x[torch.from_numpy(rng.random((s, h)) < 0.5)] = -0.0
        return x
    x = torch.from_numpy(rng.standard_normal((s, h)) * 10.0 ** rng.integers(-45, -36, size=(s, 1)))
    return x.to(dtype)  # float16 flushes these to +-0: still a valid edge case


def assert_same_bits(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    (q, scale), (q0, scale0) = got, want
    assert q.dtype == torch.uint8 and scale.dtype == torch.float32
    assert q.shape == q0.shape and scale.shape == scale0.shape
    assert torch.equal(scale.view(torch.int32), scale0.view(torch.int32))
    assert torch.equal(q, q0)


def assert_same_bits_but_nan_sign(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]
) -> None:
    (q, scale), (q0, scale0) = got, want
    nan = (q0 & 0x7F) == 0x7F  # S.1111.111: e4m3fn's only NaN
    assert torch.equal((q & 0x7F) == 0x7F, nan)
    assert_same_bits((torch.where(nan, 0x7F, q).to(torch.uint8), scale), (q0.masked_fill(nan, 0x7F), scale0))


inputs = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(KINDS),
        "s": st.integers(1, 40),
        "h": st.integers(1, 300),
        "dtype": st.sampled_from(sorted(DTYPES)),
        "seed": st.integers(0, 2**31),
        "chunk": st.sampled_from([1, 7, 64, 1000, 1 << 18]),
    }
)


@settings(max_examples=150, deadline=None)
@given(case=inputs)
def test_cpu_path_matches_the_reference_bit_for_bit(case: dict) -> None:
    x = make_input(case["kind"], case["s"], case["h"], DTYPES[case["dtype"]], case["seed"])
    before = x.clone()
    with pytest.MonkeyPatch.context() as m:  # (hypothesis: no function-scoped fixtures)
        m.setattr(fp8, "_QUANT_CHUNK_CPU", case["chunk"])  # many chunks, and a part-filled last one
        block = quantize_fp8(x)
    assert_same_bits((block.q, block.scale), reference_quantize_fp8(x, case["chunk"]))
    assert torch.equal(x.view(INT_VIEW[x.dtype]), before.view(INT_VIEW[x.dtype]))  # x untouched


@settings(max_examples=100, deadline=None)
@given(case=inputs)
def test_gpu_path_matches_the_reference_on_cpu(case: dict) -> None:
    x = make_input(case["kind"], case["s"], case["h"], DTYPES[case["dtype"]], case["seed"])
    before = x.clone()
    want = reference_quantize_fp8(x)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(fp8, "_QUANT_CHUNK", case["chunk"])
        assert_same_bits_but_nan_sign(fp8._quantize_eager(x), want)
    assert torch.equal(x.view(INT_VIEW[x.dtype]), before.view(INT_VIEW[x.dtype]))


def test_nan_sign_is_the_only_cpu_difference_of_the_gpu_paths() -> None:
    """What the NaN-sign allowance above covers, and that the CPU path keeps even that bit."""
    x = torch.full((1, 9), float("nan"), dtype=torch.float16)
    x.view(torch.int16)[:] |= torch.tensor(-(1 << 15), dtype=torch.int16)  # nine negative NaNs
    want = reference_quantize_fp8(x)
    assert want[0].tolist() == [[0xFF] * 8 + [0x7F]]  # vector loop of 8 keeps the sign, the tail drops it
    block = quantize_fp8(x)
    assert_same_bits((block.q, block.scale), want)


def test_quantize_batch_matches_the_reference_per_layer() -> None:
    xs = llm_like_layers(300, 96, 3, seed=5)
    packed = torch.stack(xs)
    q, scale = get_codec("fp8").quantize_batch(packed, [100, 200])
    for k, x in enumerate(xs):
        assert_same_bits((q[k], scale[k]), reference_quantize_fp8(x))


@cuda
@pytest.mark.cuda
@settings(max_examples=60, deadline=None)
@given(case=inputs)
def test_cuda_eager_path_matches_the_reference_exactly(case: dict) -> None:
    x = make_input(case["kind"], case["s"], case["h"], DTYPES[case["dtype"]], case["seed"]).cuda()
    want = reference_quantize_fp8(x)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(fp8, "_QUANT_CHUNK", case["chunk"])
        assert_same_bits(fp8._quantize_eager(x), want)
    block = quantize_fp8(x)
    assert_same_bits((block.q, block.scale), want)


@cuda
@pytest.mark.cuda
@settings(max_examples=60, deadline=None)
@given(case=inputs)
def test_a_gpus_codes_and_scales_are_the_cpus(case: dict) -> None:
    """The extractor quantizes on its GPU, `dflash-shards convert` on a CPU: one cache's bits either way (a
    scale divided by a Python number was multiplied by its reciprocal on CUDA: one ulp off, some tokens)."""
    x = make_input(case["kind"], case["s"], case["h"], DTYPES[case["dtype"]], case["seed"])
    block = quantize_fp8(x.cuda())
    assert_same_bits_but_nan_sign((block.q.cpu(), block.scale.cpu()), reference_quantize_fp8(x))
