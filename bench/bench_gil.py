"""How much each codec's encode, running on another thread, slows the thread that launches the forward.

    python bench/bench_gil.py [--tokens 1500 --hidden 4096 --layers 5 --seconds 3 --rounds 4 --encode-threads 1]

The extractor's main thread launches the target's forward while encode threads compress the previous
batches. A launch releases the GIL and must take it back; an encode thread that keeps taking the GIL back
(python-zstandard's streaming `compress` does so for every ~128 KB of output) makes the launcher wait, and
a launcher that falls behind leaves the GPU idle inside a batch. Here the launcher is a loop of one-element
torch ops, which release and retake the GIL like a kernel launch; its rate alone and beside encode
threads of one codec is the measure (one thread by default; `--encode-threads` as many as extraction
runs: on a many-core box one thread leaves the launcher a core and too few GIL hand-offs to show).
`fp8-streaming` is the fp8 frame as the writer built it before (the same bytes through a streaming
compressor), kept as the reference. The rounds alternate the codecs, so a noisy
machine spreads its noise over all of them; medians are reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash.shards.codec_base import compressor
from dflash.shards.codecs import get_codec
from dflash.shards.fp8 import Fp8Block, quantize_fp8
from dflash.shards.qcodec import QBlock, quantize_q


def _fp8_streaming(block: Fp8Block) -> bytes:
    scale = block.scale.float().numpy().astype("<f4", copy=False)
    q = block.q.contiguous().numpy()
    cobj = compressor(1).compressobj(size=scale.nbytes + q.nbytes)
    return cobj.compress(scale.tobytes()) + cobj.compress(memoryview(q).cast("B")) + cobj.flush()


def encoders(tokens: int, hidden: int, layers: int) -> dict[str, Callable[[int], bytes]]:
    """Per codec, encode(i): layer i % layers of one sample as the extractor hands it over (fp8 and q
    already quantized on the GPU; lossless the bf16 states)."""
    torch.manual_seed(0)
    x = (torch.randn(layers, tokens, hidden) * 0.5).bfloat16()
    fp8 = [quantize_fp8(x[k]) for k in range(layers)]
    q4 = []
    for k in range(layers):
        codes, groups, scales, channel = quantize_q(x[k], get_codec("q4").levels)
        q4.append(QBlock(codes, groups, scales, channel[0]))
    lossless, fp8_codec, q4_codec = get_codec("lossless"), get_codec("fp8"), get_codec("q4")
    return {
        "lossless": lambda i: lossless.encode(x[i % layers]),
        "fp8": lambda i: fp8_codec.encode(fp8[i % layers]),
        "fp8-streaming": lambda i: _fp8_streaming(fp8[i % layers]),
        "q4": lambda i: q4_codec.encode(q4[i % layers]),
    }


def launcher_rate(seconds: float) -> float:
    """One-element torch ops per second on this thread (each releases and retakes the GIL)."""
    a = torch.zeros(1)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(100):
            a.add_(1)
        n += 100
    return n / (time.perf_counter() - start)


def beside(encode: Callable[[int], bytes] | None, seconds: float, threads: int = 1) -> tuple[float, float]:
    """(launcher ops/s, encodes/s) with `encode` looping on `threads` other threads (None: the launcher
    alone)."""
    if encode is None:
        return launcher_rate(seconds), 0.0
    stop, done = threading.Event(), [0] * threads

    def loop(t: int) -> None:
        while not stop.is_set():
            encode(done[t] * threads + t)
            done[t] += 1

    pool = [threading.Thread(target=loop, args=(t,), daemon=True) for t in range(threads)]
    for thread in pool:
        thread.start()
    time.sleep(0.2)
    before, start = sum(done), time.perf_counter()
    rate = launcher_rate(seconds)
    encodes = (sum(done) - before) / (time.perf_counter() - start)
    stop.set()
    for thread in pool:
        thread.join()
    return rate, encodes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1500, help="tokens of one sample (one frame per layer)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument(
        "--encode-threads",
        type=int,
        default=1,
        help="encode threads beside the launcher (dflash-extract runs min(16, cores - 1))",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # as the extractor's encode threads (shards/threads.py)
    codecs = encoders(args.tokens, args.hidden, args.layers)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in ("alone", *codecs)}
    for _ in range(args.rounds):
        for name in runs:
            runs[name].append(beside(codecs.get(name), args.seconds, args.encode_threads))
    alone = statistics.median(r for r, _ in runs["alone"])
    print(
        f"{args.tokens} tokens x {args.hidden}, {args.layers} layers, {args.encode_threads} encode thread(s); "
        f"medians of {args.rounds} rounds"
    )
    print(f"{'beside':14s} {'launcher ops/s':>15s} {'vs alone':>9s} {'encodes/s':>10s}")
    for name, results in runs.items():
        rate = statistics.median(r for r, _ in results)
        encodes = statistics.median(e for _, e in results)
        print(f"{name:14s} {rate:15,.0f} {rate / alone:9.2f} {encodes:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
