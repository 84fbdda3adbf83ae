"""A lossless cache that holds what a drafter would see from another codec: every layer of every sample as the
codec decodes it, stored exactly (bf16 is what fp8 / q6 / q4 decode to, and the lossless codec keeps it bit
for bit), so a drafter trained on it is the one that codec's cache would train, on the same batches (spans of
the stored order are the same for every codec of a cache):

    python bench/simulate_codec.py W/cache-lossless W/cache-q4delta --codec q4 --layer-delta [--device cuda]
    python bench/bench_quality.py --work W ... --codecs lossless,q4,q4delta   # trains on it as `q4delta`

With `--layer-delta` the codec is one not built: each stored layer after the first kept as its difference from
the reconstruction of the layer before (closed loop, `bench_layer_delta.py`, which measures its error), so its
effect on the drafter's walk is measured before a format is written. Without it the copy is the codec's own
decode (a check of the simulation: a drafter trained on it matches one trained on the codec's cache).
Written by `dflash-shards convert`'s code (resumable, checked, manifest last) with a lossless codec whose
"quantize" step is this round trip; the copy's manifest says lossless (zstd level 2, which tells it from the
source for convert) and converted from the source.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash.shards import Cache, convert
from dflash.shards.cli import run_main
from dflash.shards.codecs import Codec, LosslessCodec, get_codec
from dflash.shards.fp8 import Fp8Codec, dequantize_fp8, quantize_fp8
from dflash.shards.qcodec import QBlock, QCodec, dequantize_q, quantize_q

from bench.bench_layer_delta import closed_loop


def round_trip_rows(
    codec: Codec, x: torch.Tensor, lengths: Sequence[int], row_of_token: torch.Tensor
) -> torch.Tensor:
    """`codec`'s decode of its encode of each row of `x` [N, H] (rows of `lengths` back to back), as one batch:
    the bits of encoding and decoding each row alone (every statistic is a row's or a token's), without the
    frames' zstd, which costs most of a per-row round trip and changes nothing it decodes."""
    if isinstance(codec, QCodec):
        codes, groups, scales, channel = quantize_q(x, codec.levels, lengths)
        return dequantize_q(QBlock(codes, groups, scales, channel), x.dtype, row_of_token=row_of_token)
    if isinstance(codec, Fp8Codec):
        return dequantize_fp8(quantize_fp8(x), x.dtype)
    raise ValueError(f"codec {codec.name!r} has no batched round trip")


class DecodedAsLossless(LosslessCodec):
    """Lossless storage of `inner`'s decode of each sample's layers (directly or as layer deltas)."""

    def __init__(self, inner: Codec, layer_delta: bool):
        super().__init__(level=2)
        self.inner, self.layer_delta = inner, layer_delta

    def quantize_batch(self, packed: torch.Tensor, lengths: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """The batch's layers as `bench_layer_delta.closed_loop` reconstructs a sample's, a layer at a time over
        all its rows (the same bits as row by row: tests)."""
        lengths = [int(n) for n in lengths]
        sizes = torch.tensor(lengths, dtype=torch.long, device=packed.device)
        row_of_token = torch.repeat_interleave(torch.arange(len(lengths), device=packed.device), sizes)
        out = torch.empty_like(packed)
        layers = closed_loop(
            packed, lambda x: round_trip_rows(self.inner, x, lengths, row_of_token), self.layer_delta
        )
        for k, rec in enumerate(layers):
            out[k] = rec.to(packed.dtype)
        return (out,)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=Path, help="a lossless cache")
    p.add_argument("out", type=Path, help="the new cache (the --out rule of every dflash command)")
    p.add_argument("--codec", default="q4", choices=("q4", "q6", "fp8"))
    p.add_argument("--layer-delta", action="store_true", help="the codec applied to closed-loop layer deltas")
    p.add_argument("--threads", type=int, default=0, help="encode threads (0: one per core)")
    p.add_argument(
        "--device", default="cpu", help="where the codec quantizes: cpu, or cuda as the extractor does"
    )
    args = p.parse_args(argv)
    with Cache.open(args.source) as source:
        if source.codec.name != "lossless":
            raise SystemExit(
                f"error: {args.source} is a {source.codec.name} cache; this needs exact states (lossless)"
            )
    codec = DecodedAsLossless(get_codec(args.codec), args.layer_delta)
    config = convert.ConvertConfig(
        source=args.source, out=args.out, codec="lossless", threads=args.threads, device=args.device
    )
    with mock.patch.object(convert, "get_codec", lambda name: codec):
        result = convert.convert_cache(config)
    print(f"{result.out}: {result.rows} rows, {result.shards} shards; {args.codec}"
          f"{' layer-delta' if args.layer_delta else ''} decode stored lossless")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, None, "simulate_codec"))
