"""What `verify` and `--max-length` rely on in the codecs: `nonfinite` counts exactly the NaN/inf values a
frame decodes to (without decoding it), and `decode_rows` / a prefix read equal the full decode cut."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from common.fake_cache import write_fake_cache
from dflash.shards import Cache
from dflash.shards.codecs import codec_names, count_nonfinite, get_codec, zstd_compress, zstd_decompress_exact
from dflash.shards.qcodec import QBlock
from hypothesis import given, settings
from hypothesis import strategies as st

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@settings(max_examples=80, deadline=None)
@given(
    codec=st.sampled_from(codec_names()),  # q4/q6 prefixes: training reads them undecoded, cut first
    dtype=st.sampled_from(list(DTYPES)),
    s=st.integers(1, 40),
    h=st.integers(1, 48),
    bad=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from([np.nan, np.inf, -np.inf])), max_size=6),
    rows=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_nonfinite_count_and_prefix_decode(codec, dtype, s, h, bad, rows, seed) -> None:
    x = torch.randn(s, h, generator=torch.Generator().manual_seed(seed)) * 3
    for pos, value in bad:
        x.view(-1)[pos % x.numel()] = value
    x = x.to(DTYPES[dtype])
    c = get_codec(codec)
    stored = c.stored_dtype(dtype)
    frame = bytes(c.encode(x))
    full = c.decode(frame, (s, h), stored)
    assert c.nonfinite(frame, (s, h), stored) == count_nonfinite(full)
    assert count_nonfinite(full) == int((~torch.isfinite(full.float())).sum())
    if codec == "lossless" and bad:
        assert count_nonfinite(full) == int((~torch.isfinite(x.float())).sum())
    cut = c.decode_rows(frame, (s, h), stored, rows)
    assert cut.shape == (min(rows, s), h)
    assert torch.equal(cut.view(torch.uint8), full[:rows].contiguous().view(torch.uint8))


def test_prefix_of_a_zstd_frame_never_decodes_the_rest() -> None:
    data = np.random.default_rng(0).integers(0, 7, 3 << 20, dtype=np.uint8).tobytes()
    frame = zstd_compress(data)
    assert bytes(zstd_decompress_exact(frame, len(data), "x", keep=1000)) == data[:1000]
    assert bytes(zstd_decompress_exact(frame, len(data), "x", keep=len(data))) == data


@pytest.mark.parametrize("codec", ["fp8", "q4"])
def test_undecoded_prefix_read_equals_the_full_read_cut(tmp_path, codec: str) -> None:
    """The loader's device-decode read (`dequantize=False`) cut to --max-length: the same blocks as a full
    read cut afterwards, for every codec the trainer decodes on its GPU."""
    with Cache.open(write_fake_cache(tmp_path / "c", num_samples=4, codec=codec, min_len=20)) as cache:
        for e in cache.entries():
            reader = cache.shard(e.shard)
            whole = reader.read(e.index, [1, 2], dequantize=False).hidden
            cut = reader.read(e.index, [1, 2], dequantize=False, max_tokens=7).hidden
            for layer, block in cut.items():
                for f in dataclasses.fields(block):
                    a, b = getattr(block, f.name), getattr(whole[layer], f.name)
                    assert torch.equal(a, b if f.name == "channel_scales" else b[:7]), (codec, f.name)


@pytest.mark.parametrize("codec", ["q6", "q4"])
def test_q_nonfinite_counts_scales_and_overflow_without_decoding(codec: str) -> None:
    """q6/q4 `nonfinite` reads token scales instead of decoding: a NaN/inf scale spoils its whole token,
    and a finite scale large enough to overflow bf16 is decoded and counted exactly."""
    c = get_codec(codec)
    h = 40
    block = QBlock(
        codes=torch.full((5, h), c.levels, dtype=torch.int8),
        group_scales=torch.zeros((5, 2), dtype=torch.uint8),  # ratio 1
        token_scales=torch.tensor([1.0, float("nan"), float("inf"), 3e38, 1e37]),
        channel_scales=torch.zeros(h, dtype=torch.int8),  # M = 1
    )
    block.codes[3, ::2] = 0  # zeros times a huge scale stay finite
    frame = bytes(c.encode(block))
    full = c.decode(frame, (5, h), "bfloat16")
    assert c.nonfinite(frame, (5, h), "bfloat16") == count_nonfinite(full) == 2 * h + h // 2
