"""Extraction throughput on one GPU: the bare truncated forward vs the whole pipeline, same batches.

    python bench/bench_extract.py [--arch qwen3_8b|qwen35_27b] [--rows N] [--codec lossless,fp8,q4]
                                  [--workdir DIR] [--json out.json]
    python bench/bench_extract.py --tiny --device cpu          # seconds, exercises the code path

A random-weight target of the chosen shape (FLOPs as real) is built in memory in bf16; only the
layers up to the last captured one exist (8B: 34 of 36, captured [1,9,17,25,33]; 27B hybrid: 62 of
64, captured [1,16,31,46,61]). The target directory on disk holds config.json (full layer count) and
the embed/lm_head matrices for CACHE/target/, so no 14-54 GB checkpoint is written. Rows are synthetic
(pyarrow, no `datasets`): lengths log-normal with median 1450 clipped to [16, 8192] like the 902k-row
set, truncated to --max-len.

Phases, in one process, with the target sped up as `dflash-extract` does on CUDA (`speed_up`: FLA short
convolution for the hybrid, torch.compile unless --no-compile): (1) bare: every planned batch staged on
the device, then the forward alone (no mask, hooks on, nothing kept), an untimed pass then a timed one;
(2) warm-up extractions on a small set; (3) for each codec `run_extraction` on the same plan, cache on
--workdir, then deleted; (4) bare again. The ratio uses the faster of the two bare runs, so a GPU that
warmed up or slowed down during the run cannot flatter the pipeline. Reported: bare tokens/s, end-to-end
tokens/s (first batch to last commit), their ratio (target >= 0.90), GPU wait fraction (CUDA events;
target <= 5%), stored bytes/token, compression ratio vs the raw states in the stored dtype (bf16 on a GPU),
CPU cores used (process CPU time / wall),
and the writer: stored MB/s against the disk's sequential rate measured on --workdir in the same run
(large writes of random bytes + fdatasync; where the disk is the limit the target is >= 0.90 of it) and
the seconds the writer waited for the disk (every commit slot busy).

Default rows keep each phase around 10-30 s on an H200 AND the lossless cache under ~25 GB (the bench box
has 64 GB of disk; the 8B shape writes ~1 GB/s): 8B 300 rows (~0.44 M tokens), 27B 150 rows (~0.22 M
tokens). Each cache is deleted after its phase. With more disk, raise --rows for longer phases.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash.extract.config import ExtractConfig
from dflash.extract.dataset import open_dataset
from dflash.extract.pipeline import run_extraction
from dflash.extract.target import CapturingTarget

from bench.bench_writer import sequential_write
from bench.extract_common import (
    ARCHS,
    MAX_LEN_CLIP,
    allocator_counters,
    batch_excess,
    build_target,
    counters_delta,
    stage_batches,
    timed_pass,
    write_rows,
)


def bare_forward(target: CapturingTarget, dataset: Path, vocab: int, max_len: int, token_budget: int) -> dict:
    """The truncated forward alone over the pipeline's plan, as the pipeline runs it (no mask, same kernels):
    inputs staged on the device first, one untimed pass (compilation, autotuning), then one timed pass."""
    staged = stage_batches(target, dataset, vocab, max_len, token_budget, mask=False)
    timed_pass(target, staged)
    timing = timed_pass(target, staged)
    tokens = int(sum(int(lengths.sum()) for _, _, lengths in staged))
    return {"tokens": tokens, **timing, "tokens_per_s": tokens / timing["seconds"], "batches": len(staged)}


@contextlib.contextmanager
def _profiled(on: bool, device: torch.device) -> Iterator[Any]:
    if not on:
        yield None
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        yield prof


def _extract_config(
    target_dir: Path, dataset: Path, out: Path, spec: dict, codec: str, args, dtype
) -> ExtractConfig:
    return ExtractConfig(
        target=target_dir,
        dataset=dataset,
        out=out,
        layers=spec["layers"],
        codec=codec,
        max_len=args.max_len,
        token_budget=args.token_budget,
        device=args.device,
        dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
        num_encode_threads=args.encode_threads,
        compile=args.compile,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=["qwen3_8b", "qwen35_27b"], default="qwen3_8b")
    p.add_argument(
        "--rows", type=int, default=None, help="dataset rows (default: per arch, see the docstring)"
    )
    p.add_argument("--codec", default="lossless,fp8,q4", help="comma-separated codecs to run end to end")
    p.add_argument(
        "--disk-gb", type=float, default=None, help="GB for the disk's own rate (default 4; tiny 0.1)"
    )
    p.add_argument("--max-len", type=int, default=3072)
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--encode-threads", type=int, default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="as dflash-extract")
    p.add_argument(
        "--workdir", type=Path, default=None, help="dataset, target stub and caches (default: a temp dir)"
    )
    p.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval in ms for the codec runs (default Python's 5): tests whether the launching "
        "thread waits for the GIL behind the drain, encode and writer threads",
    )
    p.add_argument(
        "--profile", action="store_true", help="torch.profiler over the last codec's run: its top kernels"
    )
    p.add_argument("--tiny", action="store_true", help="tiny shape (CPU smoke test of this script)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)

    arch = "tiny" if args.tiny else args.arch
    spec = ARCHS[arch]
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = args.rows or spec["rows"]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dflash-bench-extract-"))
    workdir.mkdir(parents=True, exist_ok=True)
    codecs = [c for c in args.codec.split(",") if c]
    vocab = spec["shape"]["vocab_size"]

    t = time.perf_counter()
    target_dir, target = build_target(arch, workdir, device, dtype)
    dataset = write_rows(
        workdir / f"rows-{rows}.arrow", rows, vocab, max_clip=MAX_LEN_CLIP if not args.tiny else 200
    )
    print(
        f"[setup] {arch}: target built and dataset written in {time.perf_counter() - t:.1f} s ({workdir})",
        flush=True,
    )

    # Lossless on random-weight states compresses ~1.2-1.4x: refuse early rather than fill the disk mid-phase.
    planned = int(open_dataset(dataset).seq_len.clip(max=args.max_len).sum())
    need = planned * len(spec["layers"]) * spec["shape"]["hidden_size"] * 2 / 1.2
    free = shutil.disk_usage(workdir).free
    if need > free:
        raise SystemExit(
            f"{workdir}: a cache of ~{need / 1e9:.0f} GB does not fit in {free / 1e9:.0f} GB free; lower --rows"
        )

    print(f"[speed-up] {target.speed_up(compile=args.compile) or 'none'}", flush=True)

    def measure_bare(when: str) -> dict:
        b = bare_forward(target, dataset, vocab, args.max_len, args.token_budget)
        print(
            f"[bare, {when}] {b['tokens']:,} tokens in {b['seconds']:.1f} s = {b['tokens_per_s']:,.0f} tok/s"
        )
        return b

    bare_runs = [measure_bare("before")]
    disk_gb = args.disk_gb if args.disk_gb is not None else (0.1 if args.tiny else 4.0)
    disk = sequential_write(workdir / "disk-rate.bin", int(disk_gb * 1e9), os.urandom(16 << 20))
    print(f"[disk] sequential write + fdatasync on {workdir}: {disk['gb_per_s']:.2f} GB/s", flush=True)

    # Warm the pipeline (kernels, pinned host blocks of the caching host allocator: ~1 GB each for the
    # 8B shape, slow to allocate the first time) on a separate small set, so phases compare steady states.
    warm_rows = 20 if args.tiny else 80
    warm = write_rows(
        workdir / "warm.arrow", warm_rows, vocab, seed=1, max_clip=MAX_LEN_CLIP if not args.tiny else 200
    )
    for codec in dict.fromkeys(codecs):
        t = time.perf_counter()
        run_extraction(
            _extract_config(target_dir, warm, workdir / f"warm-{codec}", spec, codec, args, dtype),
            target=target,
        )
        shutil.rmtree(workdir / f"warm-{codec}", ignore_errors=True)
        print(f"[warm-up] {codec}: {time.perf_counter() - t:.1f} s", flush=True)

    results = {
        "arch": arch,
        "rows": rows,
        "layers": spec["layers"],
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cpu_count": os.cpu_count(),
        "max_len": args.max_len,
        "token_budget": args.token_budget,
        "compile": args.compile,
        "bare_runs": bare_runs,
        "disk": disk,
        "pipeline": {},
    }
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval / 1e3)
        results["switch_interval_ms"] = args.switch_interval
    for i, codec in enumerate(codecs):
        out = workdir / f"cache-{codec}"
        shutil.rmtree(out, ignore_errors=True)
        cfg = _extract_config(target_dir, dataset, out, spec, codec, args, dtype)
        counters = allocator_counters(device)
        with _profiled(args.profile and i == len(codecs) - 1, device) as prof:
            r = run_extraction(cfg, target=target)
        allocator = counters_delta(counters, allocator_counters(device))
        if prof is not None:
            sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
            print(f"[profile] {codec}: top ops by self device time\n"
                  + prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60))  # fmt: skip
        d = r.to_dict()
        d["batches_vs_bare"] = batch_excess(r.batch_times, bare_runs[0]["batch_ms"])
        d["allocator"] = allocator
        d["raw_bf16_bytes_per_token"] = len(spec["layers"]) * spec["shape"]["hidden_size"] * 2
        d["compression_vs_bf16"] = (
            d["raw_bf16_bytes_per_token"] / r.bytes_per_token if r.bytes_per_token else 0.0
        )
        d["write_gb_per_s"] = r.bytes_written / r.extract_seconds / 1e9 if r.extract_seconds else 0.0
        d["write_vs_disk"] = d["write_gb_per_s"] / disk["gb_per_s"]
        # a codec named twice (--codec fp8,lossless,fp8) is run twice: does the order matter?
        results["pipeline"][
            codec if codec not in codecs[:i] else f"{codec}#{codecs[:i].count(codec) + 1}"
        ] = d
        shutil.rmtree(out, ignore_errors=True)
    bare_runs.append(measure_bare("after"))
    bare = max(bare_runs, key=lambda b: b["tokens_per_s"])
    results["bare"] = bare
    for d in results["pipeline"].values():
        d["ratio_to_bare"] = d["tokens_per_s"] / bare["tokens_per_s"]

    print(f"\n{arch}: {rows} rows, {bare['tokens']:,} tokens, layers {spec['layers']}, {results['gpu']}")
    print(
        "bare truncated forward: "
        + " / ".join(f"{b['tokens_per_s']:,.0f}" for b in bare_runs)
        + " tokens/s (before / after the pipelines; the ratio uses the faster)"
    )
    print(
        f"{'codec':<10}{'tok/s':>10}{'vs bare':>9}{'GPU wait':>10}{'B/token':>9}{'ratio':>7}{'CPU cores':>11}"
        f"{'write GB/s':>12}{'vs disk':>9}{'writer busy/disk wait s':>25}"
    )
    for codec, d in results["pipeline"].items():
        w = d["stages"].get("write", {})
        print(
            f"{codec:<10}{d['tokens_per_s']:>10,.0f}{d['ratio_to_bare']:>9.2f}{d['gpu_wait_fraction']:>10.1%}"
            f"{d['bytes_per_token']:>9,.0f}{d['compression_vs_bf16']:>7.2f}{d['cpu_cores_used']:>11.1f}"
            f"{d['write_gb_per_s']:>12.2f}{d['write_vs_disk']:>9.2f}"
            f"{w.get('busy_s', 0.0):>15.1f} / {w.get('wait_out_s', 0.0):.1f}"
        )
    print(
        "per batch against the bare forward (GPU ms more than bare: total / median / p90 / first three; "
        "the main thread's ms per batch; GPU ms per batch, medians):"
    )
    for codec, d in results["pipeline"].items():
        b = d["batches_vs_bare"]
        if b:
            print(f"  {codec:<10} excess {b['excess_ms_total']:,.0f} / {b['excess_ms_median']:.1f} / "
                  f"{b['excess_ms_p90']:.1f} / {b['excess_ms_first3']} ms over {b['batches']} batches; "
                  f"host {b['host_ms_median']:.1f} ms, GPU {b['gpu_ms_median']:.1f} ms")  # fmt: skip
        if d["allocator"]:
            print(f"  {'':<10} allocators during the run: " + ", ".join(
                f"{k} {v:,.0f}" for k, v in d["allocator"].items()))  # fmt: skip
    print(
        f"disk: {disk['gb_per_s']:.2f} GB/s sequential. targets: vs bare >= 0.90 and GPU wait <= 5%, "
        "or (disk-bound) write >= 0.90 of the disk"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
