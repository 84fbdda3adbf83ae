"""What q4 / q6 would cost if each layer were stored as its difference from the previous stored layer.

    python bench/bench_layer_delta.py CACHE [--codec q4] [--rows 32]
    python bench/bench_layer_delta.py --tiny      # a synthetic cache (independent layers: a smoke run)

Reads rows of a lossless cache (real hidden states: synthetic ones have no residual stream) and, per stored
layer, compares the codec's relative error ||decoded - x|| / ||x|| and bytes when the layer is encoded
directly (what the cache stores today) against a closed-loop layer delta: layer k is stored as
x_k - rec_{k-1}, where rec_{k-1} is what a reader reconstructs of layer k-1, so errors do not add up over
the layers. Also prints each layer's ||x_k - x_{k-1}|| / ||x_k||: a residual stream whose stored layers are
close (adjacent layers of a small target) gains, widely spaced layers (every 8th of a 36-layer Qwen3) less.
An exploration for a possible codec, not a format: nothing here is written.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common.synth import make_cache
from dflash.shards import Cache
from dflash.shards.codecs import Codec, get_codec


def closed_loop(
    states: Iterable[torch.Tensor], round_trip: Callable[[torch.Tensor], torch.Tensor], layer_delta: bool
) -> Iterator[torch.Tensor]:
    """Each stored layer as a reader reconstructs it (float32), from `round_trip` (bf16 in, its decode out):
    directly, or (`layer_delta`) every layer after the first as its difference from the reader's
    reconstruction of the layer before (closed loop: the errors do not add up). One definition for this
    measure and for `simulate_codec.py`'s caches, whose drafters must see exactly what it measured."""
    rec = None
    for x in states:
        delta = layer_delta and rec is not None
        d = round_trip((x.float() - rec if delta else x.float()).bfloat16()).float()
        rec = rec + d if delta else d
        yield rec


def decoded_layers(
    codec: Codec, states: list[torch.Tensor], layer_delta: bool
) -> tuple[list[torch.Tensor], int]:
    """One sample's stored layers as a reader would decode them (float32, `closed_loop`), and their encoded
    bytes."""
    sizes: list[int] = []

    def round_trip(x: torch.Tensor) -> torch.Tensor:
        frame = codec.encode(x)
        sizes.append(len(frame))
        return codec.decode(frame, tuple(x.shape), "bfloat16")

    out = list(closed_loop(states, round_trip, layer_delta))
    return out, sum(sizes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cache", nargs="?", help="a lossless cache directory")
    p.add_argument("--tiny", action="store_true", help="a small synthetic cache instead (smoke run)")
    p.add_argument("--codec", default="q4", choices=("q4", "q6", "fp8"))
    p.add_argument("--rows", type=int, default=32, help="rows read, evenly spaced over the cache")
    args = p.parse_args(argv)
    if args.tiny:
        with tempfile.TemporaryDirectory() as tmp:
            make_cache(Path(tmp) / "c", [40, 7, 90], layers=(1, 2, 3), hidden=64)
            return measure(Path(tmp) / "c", args)
    if not args.cache:
        p.error("give a lossless cache directory, or --tiny")
    return measure(Path(args.cache), args)


def measure(path: Path, args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    codec = get_codec(args.codec)
    with Cache.open(path) as cache:
        if cache.codec.name != "lossless":
            print(f"error: {path} is a {cache.codec.name} cache; this needs exact states (lossless)")
            return 2
        layers = cache.layers
        stored = sorted(e.row for e in cache.entries())
        rows = [stored[i] for i in np.linspace(0, len(stored) - 1, args.rows).astype(int)]
        err = {"direct": np.zeros(len(layers)), "delta": np.zeros(len(layers)), "gap": np.zeros(len(layers))}
        size = {"direct": 0, "delta": 0}
        for row in rows:
            sample = cache.read(row)
            states = [sample.hidden[layer].float() for layer in layers]
            for way in ("direct", "delta"):
                ys, n = decoded_layers(codec, states, way == "delta")
                size[way] += n
                for k, (x, y) in enumerate(zip(states, ys, strict=True)):
                    err[way][k] += float((y - x).norm() / x.norm().clamp_min(1e-12))
            for k in range(1, len(states)):
                err["gap"][k] += float((states[k] - states[k - 1]).norm() / states[k].norm().clamp_min(1e-12))
    print(f"{args.codec}, {len(rows)} rows of {path}: mean relative error per stored layer")
    print(f"{'layer':>6}{'direct':>10}{'delta':>10}{'|x_k - x_k-1| / |x_k|':>26}")
    for k, layer in enumerate(layers):
        gap = f"{err['gap'][k] / len(rows):.3f}" if k else "-"
        print(f"{layer:>6}{err['direct'][k] / len(rows):>10.3f}{err['delta'][k] / len(rows):>10.3f}{gap:>26}")
    print(
        f"bytes: direct {size['direct']:,}, delta {size['delta']:,} ({size['delta'] / size['direct'] - 1:+.1%})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
