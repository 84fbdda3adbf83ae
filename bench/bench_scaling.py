"""Multi-GPU scaling on one host: torchrun extraction and DDP training on 1 and N devices, and SIGKILL faults.

    python bench/bench_scaling.py [--nproc N] [--phases extract,train,faults] [--json out.json]
    python bench/bench_scaling.py --tiny --device cpu --nproc 2      # CPU + gloo: every phase, tiny shapes

N defaults to torch.cuda.device_count(). Every process started here has NVLink multicast off
(NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1). Ranks run
`bench/scaling_worker.py` (the real extraction with the random-weight target built in memory, the real
`dflash-train` with per-rank timers).
1. extract: the Qwen3-8B-shaped target (captured layers [1,9,17,25,33]), for each codec `torchrun
   --nproc-per-node 1` then N over the same rows (`--rows-per-gpu` x N). Aggregate tokens/s = all ranks'
   tokens over the slowest rank's staged extraction (first batch to last commit; compilation is warmed up
   before); per-rank GPU wait; disk write rate next to `dd`'s on the same filesystem; CPU cores used (all
   ranks); `dflash-shards verify --dataset` on the N-run cache. Efficiency = tokens/s(N) / (N x tokens/s(1)).
   Work units of `--unit-size` (256 MiB: ~8k tokens of the 8B shape) keep the last wave of units short.
2. train: the 8B-shaped drafter (paper recipe: 5 layers, B=16, 512 anchors) on the N-run cache of the
   last codec, DDP on 1 and N devices, `--attention flex` and `auto` (auto only off CUDA): aggregate context
   tokens/s from metrics.jsonl after `--warmup-steps`, efficiency, data wait on every rank after its first
   step, time from the launch to every rank's first optimizer step.
3. faults: SIGKILL the last rank mid-extraction (fp8); the same command resumes and is killed again if it
   runs long enough, then N/2 processes finish; `verify --dataset`, and the shards compared with the
   uninterrupted N-run cache's. SIGKILL the last rank mid-training once its checkpoint is written;
   `--resume`: every later step's loss against an uninterrupted run's.
Targets (issue 15): extraction efficiency >= 90% per GPU or a named limit (disk: >= 80% of dd's rate; CPU:
>= 80% of the cores), training efficiency >= 90%, data wait <= 2% on every rank, faults pass.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
from dflash.extract.dataset import open_dataset
from dflash.tools.shards_cli import main as shards_main
from dflash.train.metrics import read_metrics

from bench.extract_common import ARCHS, write_rows, write_target_stub
from bench.scaling_faults import extraction_fault, training_fault
from tests.common.train_cli import torchrun

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
WORKER = Path(__file__).with_name("scaling_worker.py")
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Launch:
    code: int
    wall_s: float
    ranks: list[dict[str, Any]]
    killed: int = 0  # how many ranks were SIGKILLed
    log: str = ""


@dataclass
class Bench:
    args: argparse.Namespace
    arch: str
    work: Path
    dataset: Path
    target: Path
    results: dict[str, Any] = field(default_factory=dict)

    # --- launching ranks -----------------------------------------------------------------------------
    def launch(
        self, label: str, kind: str, n: int, argv: list, kill_when: Callable[[], bool] | None = None
    ) -> Launch:
        """`torchrun` n ranks of the worker; SIGKILL the last rank once `kill_when()` holds."""
        bench_dir = self.work / "launches" / label
        shutil.rmtree(bench_dir, ignore_errors=True)
        bench_dir.mkdir(parents=True)
        env = {
            **os.environ,
            **NO_MULTICAST,
            "DFLASH_BENCH_DIR": str(bench_dir),
            "DFLASH_BENCH_ARCH": self.arch,
        }
        env.update(DFLASH_BENCH_LAUNCH=repr(time.time()), OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
        cmd = [*torchrun(n), str(WORKER), kind, *map(str, argv)]
        killed = 0
        t = time.perf_counter()
        with open(bench_dir / "log.txt", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
            while proc.poll() is None:
                pid_file = bench_dir / f"rank{n - 1}.pid"
                if kill_when is not None and not killed and pid_file.is_file() and kill_when():
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)
                    killed = 1
                time.sleep(0.05)
        ranks = [
            json.loads((bench_dir / f"rank{r}.json").read_text())
            for r in range(n)
            if (bench_dir / f"rank{r}.json").is_file()
        ]
        tail = (bench_dir / "log.txt").read_text(errors="replace")[-2000:]
        out = Launch(proc.returncode, time.perf_counter() - t, ranks, killed, tail)
        print(
            f"[{label}] {n} rank(s): exit {out.code}{' (one killed)' if killed else ''} in {out.wall_s:.1f} s",
            flush=True,
        )
        if out.code != 0 and not killed:
            print(tail, file=sys.stderr)
        return out

    # --- phase 1 -------------------------------------------------------------------------------------
    def extract_argv(self, out: Path, codec: str) -> list[str]:
        a = self.args
        return flags(
            target=self.target, dataset=self.dataset, out=out, layers=ARCHS[self.arch]["layers"], codec=codec,
            max_len=a.max_len, token_budget=a.token_budget, unit_size=a.unit_size, device=a.device, dtype="auto",
            json=True,
        )  # fmt: skip

    def extract_run(self, codec: str, n: int) -> dict[str, Any]:
        out = self.work / f"cache-{codec}-{n}"
        shutil.rmtree(out, ignore_errors=True)
        run = self.launch(f"extract-{codec}-{n}", "extract", n, self.extract_argv(out, codec))
        if run.code != 0 or len(run.ranks) != n:
            raise SystemExit(f"extraction {codec} on {n} rank(s) failed (exit {run.code})")
        slowest = max(r["extract_seconds"] for r in run.ranks)
        tokens = sum(r["tokens"] for r in run.ranks)
        written = sum(r["bytes_written"] for r in run.ranks)
        return {
            "n": n,
            "cache": str(out),
            "wall_s": run.wall_s,
            "tokens": tokens,
            "seconds": slowest,
            "tokens_per_s": tokens / slowest,
            "write_gb_s": written / slowest / 1e9,
            "cpu_cores": sum(r["cpu_seconds"] for r in run.ranks) / slowest,
            "gpu_wait": [round(r["gpu_wait_fraction"], 4) for r in run.ranks],
            "warmup_s": max(r["warmup_s"] for r in run.ranks),
        }

    def phase_extract(self) -> None:
        n, res = self.args.nproc, {"dd_gb_s": dd_write_rate(self.work, self.args.tiny)}
        for codec in self.args.codecs:
            runs = [self.extract_run(codec, k) for k in sorted({1, n})]
            one, many = runs[0], runs[-1]
            if n > 1:
                shutil.rmtree(one["cache"], ignore_errors=True)
            t = time.perf_counter()
            many["verify_ok"] = shards_main(["verify", many["cache"], "--dataset", str(self.dataset)]) == 0
            many["verify_s"] = time.perf_counter() - t
            disk_bound = many["write_gb_s"] >= 0.8 * res["dd_gb_s"]
            cpu_bound = many["cpu_cores"] >= 0.8 * (os.cpu_count() or 1)
            res[codec] = {
                "runs": runs,
                "efficiency": many["tokens_per_s"] / (n * one["tokens_per_s"]),
                "limit": "disk" if disk_bound else "CPU" if cpu_bound else None,
            }
            if codec != self.args.codecs[-1]:
                shutil.rmtree(many["cache"], ignore_errors=True)
        self.results["extract"] = res

    # --- phase 2 -------------------------------------------------------------------------------------
    def train_argv(
        self,
        cache: Path,
        run: Path,
        attention: str,
        steps: int,
        save_every: int,
        log_every: int | None = None,
    ) -> list[str]:
        a, spec = self.args, ARCHS[self.arch]
        drafter = {"preset": "tiny", "num_draft_layers": 2} if a.tiny else {"num_draft_layers": 5}
        # The first unused row of the embedding table: Qwen3's (151669 of 151936), the tiny table's last.
        mask = spec["shape"]["vocab_size"] - 1 if a.tiny else 151669
        return flags(
            **drafter, cache=cache, out=run, device=a.device, attention=attention,
            target_layer_ids=spec["layers"], mask_token_id=mask, max_steps=steps, epochs=1000,
            log_every=log_every or a.log_every, eval_every=0, save_every=save_every, no_tensorboard=True,
            no_plots=True, no_progress=True,
        )  # fmt: skip

    def train_run(self, cache: Path, attention: str, n: int) -> dict[str, Any]:
        a = self.args
        run_dir = self.work / f"run-{attention}-{n}"
        shutil.rmtree(run_dir, ignore_errors=True)
        run = self.launch(
            f"train-{attention}-{n}", "train", n, self.train_argv(cache, run_dir, attention, a.steps, a.steps)
        )
        records = [r for r in read_metrics(run_dir) if "tokens_per_s" in r] if run_dir.is_dir() else []
        steady = [r for r in records if r["step"] > a.warmup_steps]
        shutil.rmtree(run_dir, ignore_errors=True)  # the 8B drafter's checkpoint is ~13 GB
        if run.code != 0 or not steady:
            return {"n": n, "failed": f"exit {run.code}", "log": run.log[-500:]}
        return {
            "n": n,
            "wall_s": run.wall_s,
            "tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady),
            "data_wait": [r["data_wait_frac"] for r in run.ranks],
            "first_step_s": [r.get("first_step_s") for r in run.ranks],
        }

    def phase_train(self) -> None:
        n = self.args.nproc
        cache = self.work / f"cache-{self.args.codecs[-1]}-{n}"
        res = {}
        for attention in ["flex", "auto"] if self.args.device == "cuda" else ["auto"]:
            runs = [self.train_run(cache, attention, k) for k in sorted({1, n})]
            ok = all("tokens_per_s" in r for r in runs)
            eff = runs[-1]["tokens_per_s"] / (n * runs[0]["tokens_per_s"]) if ok else None
            res[attention] = {"runs": runs, "efficiency": eff}
        self.results["train"] = res


def setup_inputs(work: Path, arch: str, rows: int, max_len: int) -> tuple[Path, Path]:
    """The rows and the target stub (config.json + random embed/lm_head), reused when `work` already holds
    them for the same settings (phases may run as separate invocations on one --workdir)."""
    key = {"arch": arch, "rows": rows, "max_len": max_len}
    stamp, dataset, target = work / "inputs.json", work / "rows.arrow", work / "target"
    if stamp.is_file() and json.loads(stamp.read_text()) == key:
        return dataset, target
    shape = ARCHS[arch]["shape"]
    write_rows(dataset, rows, shape["vocab_size"], max_clip=max_len)
    g = torch.Generator().manual_seed(0)
    embed, head = (
        torch.randn(shape["vocab_size"], shape["hidden_size"], generator=g).mul_(0.02).bfloat16()
        for _ in range(2)
    )
    write_target_stub(arch, target, embed, head)
    stamp.write_text(json.dumps(key))
    return dataset, target


def flags(**values: Any) -> list[str]:
    """CLI arguments: key=value -> --key value (lists comma-joined), key=True -> --key."""
    argv = []
    for key, value in values.items():
        argv.append("--" + key.replace("_", "-"))
        if value is not True:
            argv.append(",".join(map(str, value)) if isinstance(value, list) else str(value))
    return argv


def dd_write_rate(where: Path, tiny: bool) -> float:
    """GB/s `dd` writes on `where`'s filesystem, flushed to the device (conv=fdatasync)."""
    path = where / "dd.tmp"
    count = 64 if tiny else 4096  # MiB: 4 GiB is past most write caches
    proc = subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={count}", "conv=fdatasync"],
        capture_output=True,
        text=True,
    )
    path.unlink(missing_ok=True)
    match = re.search(r"(\d+) bytes.*copied, ([\d.]+) s", proc.stderr)
    return int(match.group(1)) / float(match.group(2)) / 1e9 if match else float("nan")


def _pct(values: list[float]) -> str:
    return f"{max(values):.1%}" if values and None not in values else "-"


def print_table(r: dict[str, Any]) -> None:
    print(
        f"\n{r['arch']} target, {r['nproc']} x {r['device_name']}, {r['tokens']:,} tokens in {r['rows']} rows"
    )
    if "extract" in r:
        e = r["extract"]
        print(f"extraction (disk: dd {e['dd_gb_s']:.2f} GB/s)")
        print(
            f"{'codec':<10}{'ranks':>6}{'tok/s':>11}{'per rank':>10}{'eff':>7}{'GPU wait':>10}"
            f"{'GB/s':>7}{'cores':>7}{'verify':>9}  limit"
        )
        for codec in r["codecs"]:
            if codec not in e:
                continue
            for run in e[codec]["runs"]:
                many = run["n"] > 1 or r["nproc"] == 1
                verify = (
                    (f"{'ok' if run['verify_ok'] else 'FAIL'} {run['verify_s']:.0f}s")
                    if "verify_ok" in run
                    else ""
                )
                print(
                    f"{codec:<10}{run['n']:>6}{run['tokens_per_s']:>11,.0f}{run['tokens_per_s'] / run['n']:>10,.0f}"
                    f"{e[codec]['efficiency'] if many else 1.0:>7.2f}{_pct(run['gpu_wait']):>10}"
                    f"{run['write_gb_s']:>7.2f}{run['cpu_cores']:>7.1f}{verify:>9}  "
                    f"{(e[codec]['limit'] or '') if many else ''}"
                )
    if "train" in r:
        print(f"training (drafter of the {r['arch']} target, cache {r['codecs'][-1]}; warm-up steps skipped)")
        print(f"{'attention':<10}{'ranks':>6}{'tok/s':>11}{'eff':>7}{'data wait max':>15}{'1st step s':>12}")
        for attention, t in r["train"].items():
            for run in t["runs"]:
                if "failed" in run:
                    print(f"{attention:<10}{run['n']:>6}  FAILED ({run['failed']})")
                    continue
                eff = t["efficiency"] if run["n"] > 1 and t["efficiency"] is not None else 1.0
                print(
                    f"{attention:<10}{run['n']:>6}{run['tokens_per_s']:>11,.0f}{eff:>7.2f}"
                    f"{_pct(run['data_wait']):>15}{max(run['first_step_s']):>12.1f}"
                )
    if "faults" in r:
        fe, ft = r["faults"]["extract"], r["faults"]["train"]
        chain = " -> ".join(f"{x['n']} rank(s){' killed' if x['killed'] else ''}" for x in fe["runs"])
        print(
            f"fault, extraction: {chain}; verify {'ok' if fe['verify_ok'] else 'FAIL'}, identical shards "
            f"{fe['identical_shards']}: {'PASS' if fe['pass'] else 'FAIL'}"
        )
        print(
            f"fault, training: killed after the step-{ft['checkpoint_step']} checkpoint, resumed from step "
            f"{ft.get('resumed_from')}; max |loss diff| "
            f"{ft['max_abs_loss_diff']:.2e} over {ft['compared_steps']} steps: {'PASS' if ft['pass'] else 'FAIL'}"
        )
    print("targets: efficiency >= 0.90 (or a named limit), data wait <= 2% on every rank, faults PASS")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=None, help="N (default: the CUDA device count)")
    p.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--tiny", action="store_true", help="the tiny target and drafter (CPU smoke run)")
    p.add_argument("--phases", default="extract,train,faults")
    p.add_argument("--codecs", default="lossless,fp8", help="extraction codecs; the last one feeds training")
    p.add_argument("--rows-per-gpu", type=int, default=None, help="rows = this x N (default 150; tiny 100)")
    p.add_argument("--max-len", type=int, default=None)
    p.add_argument("--token-budget", type=int, default=None)
    p.add_argument("--unit-size", default=None, help="extraction work unit (default 256MiB; tiny 1MiB)")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 60; tiny 12)")
    p.add_argument("--warmup-steps", type=int, default=None, help="steps left out of tokens/s (20; tiny 4)")
    p.add_argument("--log-every", type=int, default=None)
    p.add_argument("--fault-steps", type=int, default=None, help="training fault runs (default 40; tiny 8)")
    p.add_argument("--loss-tolerance", type=float, default=1e-3, help="resumed vs uninterrupted |loss diff|")
    p.add_argument("--workdir", type=Path, default=None, help="default: a temp dir, removed at the end")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    a.nproc = a.nproc or (torch.cuda.device_count() if a.device == "cuda" else 2)
    a.codecs = [c for c in a.codecs.split(",") if c]
    tiny = dict(rows_per_gpu=100, max_len=200, token_budget=2048, unit_size="1MiB", steps=12, warmup_steps=4,
                log_every=2, fault_steps=8)  # fmt: skip
    full = dict(rows_per_gpu=150, max_len=3072, token_budget=16384, unit_size="256MiB", steps=60, warmup_steps=20,
                log_every=5, fault_steps=40)  # fmt: skip
    for key, value in (tiny if a.tiny else full).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.nproc < 2 and "faults" in a.phases:
        raise SystemExit("faults need --nproc >= 2 (one rank is killed)")
    arch = "tiny" if a.tiny else "qwen3_8b"
    work = a.workdir or Path(tempfile.mkdtemp(prefix="dflash-scaling-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.update(NO_MULTICAST)  # inherited by every process started from here
    rows = a.rows_per_gpu * a.nproc
    dataset, target = setup_inputs(work, arch, rows, a.max_len)
    bench = Bench(a, arch, work, dataset, target)
    bench.results.update(
        arch=arch,
        nproc=a.nproc,
        rows=rows,
        codecs=a.codecs,
        tokens=int(open_dataset(dataset).seq_len.sum()),
        settings={k: str(v) for k, v in vars(a).items()},
    )
    phases = a.phases.split(",")
    if "extract" in phases:
        bench.phase_extract()
    elif not (work / f"cache-{a.codecs[-1]}-{a.nproc}").is_dir():
        bench.extract_run(a.codecs[-1], a.nproc)  # training and the fault comparison need it
    if "train" in phases:
        bench.phase_train()
    if "faults" in phases:
        reference = work / f"cache-{a.codecs[-1]}-{a.nproc}"
        bench.results["faults"] = {
            "extract": extraction_fault(bench, reference),
            "train": training_fault(bench, reference),
        }
    bench.results["device_name"] = torch.cuda.get_device_name() if a.device == "cuda" else "CPU process"
    print_table(bench.results)
    if a.json:
        a.json.write_text(json.dumps(bench.results, indent=1, default=str))
    if a.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
