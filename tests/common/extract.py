"""Helpers shared by the extraction tests: a tiny target + dataset pair, configs, cache comparisons."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from dflash.extract.config import ExtractConfig
from dflash.extract.result import ExtractResult
from dflash.shards.cache import Cache
from dflash.shards.paths import SHARDS_DIR

from tests.common.datasets import make_rows, write_save_to_disk

LAYERS = [0, 1, 2]  # of the 4-layer tiny targets: the reference can check all of them (not the last)


def tiny_rows(n: int = 24, *, seed: int = 0, max_len: int = 40) -> list[tuple[np.ndarray, np.ndarray]]:
    """Rows for the tiny targets (vocab 256): row 3 empty, row 5 unsupervised (both skipped)."""
    return make_rows(n, seed=seed, min_len=1, max_len=max_len, vocab=256, empty=(3,), unsupervised=(5,))


def cpu_extract_argv(target: Path, dataset: Path, out: Path, *extra: str) -> list[str]:
    """`dflash-extract` arguments for a tiny fp32 CPU extraction of layers 0-2 (hostile-input tests)."""
    return [
        "--target", str(target), "--dataset", str(dataset), "--out", str(out), "--layers", "0,1,2",
        "--device", "cpu", "--dtype", "float32", "--token-budget", "256", "--max-len", "32", "--json", *extra,
    ]  # fmt: skip


def write_dataset(root: Path, rows: list, *, rows_per_batch: int = 7) -> Path:
    """save_to_disk layout with several record batches (multi-chunk)."""
    return write_save_to_disk(rows, Path(root) / "dataset", num_files=2, rows_per_batch=rows_per_batch)


def make_config(
    target: Path, dataset: Path, out: Path, *, unit_bytes: int | None = None, **kw
) -> ExtractConfig:
    """A CPU fp32 config; `unit_bytes` below ExtractConfig's 1 MiB floor is set after validation so tiny
    datasets still make several units (= shards)."""
    kw.setdefault("layers", LAYERS)
    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", "float32")
    kw.setdefault("token_budget", 256)
    kw.setdefault("max_len", 32)
    cfg = ExtractConfig(target=target, dataset=dataset, out=out, **kw)
    if unit_bytes is not None:
        cfg.unit_bytes = unit_bytes
    return cfg


def reference_setup(
    root: Path, rows: list, *, rows_per_batch: int, unit_bytes: int, token_budget: int = 128
) -> tuple[dict[str, Any], ExtractResult]:
    """A tiny qwen3 target and a dataset of `rows` under `root`, extracted once, uninterrupted, into
    root/reference: what interrupted and multi-process runs on the same inputs must reproduce.

    Returns the paths (root, target, dataset, reference) plus `spec`, the Launcher spec for runs on the
    same inputs (add "out"), and the reference run's result."""
    from dflash.extract.pipeline import run_extraction

    from tests.common.targets import make_target

    target = make_target(root, "qwen3")
    dataset = write_dataset(root, rows, rows_per_batch=rows_per_batch)
    reference = root / "reference"
    config = make_config(target, dataset, reference, unit_bytes=unit_bytes, token_budget=token_budget)
    result = run_extraction(config)
    spec = {
        "target": str(target),
        "dataset": str(dataset),
        "unit_bytes": unit_bytes,
        "token_budget": token_budget,
        "json": True,
    }
    return {"root": root, "target": target, "dataset": dataset, "reference": reference, "spec": spec}, result


def shard_bytes(cache_dir: Path) -> dict[str, bytes]:
    d = Path(cache_dir) / SHARDS_DIR
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def samples_by_row(cache_dir: Path) -> dict[int, object]:
    with Cache.open(cache_dir) as cache:
        return {e.row: cache.read(e.row) for e in cache.entries()}


# --- forking launcher for the SIGKILL and multi-process tests ---------------------------------------
# `python -m tests.common.extract` imports torch/transformers/dflash ONCE, runs no torch op itself (so
# forking is safe: no OpenMP pool exists yet), and then serves JSON requests on stdin, one per line:
#   {"op": "run", "spec": {...make_config kwargs...}, "delay": s, "env": {...}, "log": path,
#    "publish_delay": s, "marker": path} -> {"pid": N}
#   {"op": "poll", "pid": N} -> {"code": int | null}      {"op": "wait", "pid": N} -> {"code": int}
# Each run is a forked child that extracts and exits (0 when this rank saw the cache complete or is not
# rank 0, 3 otherwise); a child killed by a signal reports -signum. Test processes pay the imports once.


def _run_child(request: dict) -> int:
    import json  # noqa: F401 - keeps the child self-contained
    import os
    import time

    from dflash.extract import stages
    from dflash.extract.pipeline import run_extraction

    os.environ.update(request.get("env", {}))
    delay = float(request.get("delay", 0.0))
    if delay:
        step = stages.GpuStep.__call__

        def slow_step(self, item):
            time.sleep(delay)
            return step(self, item)

        stages.GpuStep.__call__ = slow_step
    publish_delay = float(request.get("publish_delay", 0.0))
    if publish_delay:  # every commit stays in flight a while, announced by a marker file
        from dflash.shards import writer

        publish = writer.ShardWriter.publish

        def slow_publish(self):
            Path(request["marker"]).write_text(self.path.name)
            time.sleep(publish_delay)
            return publish(self)

        writer.ShardWriter.publish = slow_publish
    spec = dict(request["spec"])
    unit_bytes = spec.pop("unit_bytes", None)
    cfg = make_config(
        Path(spec.pop("target")),
        Path(spec.pop("dataset")),
        Path(spec.pop("out")),
        unit_bytes=unit_bytes,
        **spec,
    )
    result = run_extraction(cfg, takeover_grace_s=float(request.get("takeover_grace_s", 60.0)))
    return 0 if result.complete or result.rank != 0 else 3


def _code(status: int) -> int:
    import os

    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _serve() -> None:
    import json
    import os
    import sys
    import traceback

    import dflash.extract.pipeline
    import dflash.extract.stages  # noqa: F401
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "run":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    log = os.open(req.get("log", os.devnull), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    os.dup2(log, 1)
                    os.dup2(log, 2)
                    code = _run_child(req)
                except BaseException:
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            reply = {"pid": pid}
        elif req["op"] == "poll":
            got, status = os.waitpid(req["pid"], os.WNOHANG)
            reply = {"code": _code(status) if got else None}
        else:
            reply = {"code": _code(os.waitpid(req["pid"], 0)[1])}
        print(json.dumps(reply), flush=True)


class Launcher:
    """The test side of the forking launcher: run/poll/wait/kill extraction children cheaply."""

    def __init__(self) -> None:
        import json
        import os
        import subprocess
        import sys

        repo = Path(__file__).resolve().parents[2]
        env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self._json = json
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.common.extract"],
            cwd=repo,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._reply().get("ready"), "launcher did not start"

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"launcher exited with {self.proc.wait()}")
        return self._json.loads(line)

    def _ask(self, **req: object) -> dict:
        self.proc.stdin.write(self._json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def run(
        self,
        spec: dict,
        *,
        delay: float = 0.0,
        env: dict | None = None,
        log: str | None = None,
        takeover_grace_s: float = 60.0,
        publish_delay: float = 0.0,
        marker: str | None = None,
    ) -> int:
        req = {
            "op": "run",
            "spec": spec,
            "delay": delay,
            "env": env or {},
            "takeover_grace_s": takeover_grace_s,
            "publish_delay": publish_delay,
            "marker": marker,
        }
        if log:
            req["log"] = log
        return int(self._ask(**req)["pid"])

    def poll(self, pid: int) -> int | None:
        return self._ask(op="poll", pid=pid)["code"]

    def wait(self, pid: int) -> int:
        return int(self._ask(op="wait", pid=pid)["code"])

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


if __name__ == "__main__":
    _serve()
