"""How much an S3 range-read client, on reader threads, slows a loop on another thread (the GIL, the cores).

    python bench/bench_s3_gil.py [--range-kb 100,1024 --readers 4 --seconds 3 --rounds 3 --rate 40]
                                 [--loop counter|launcher]

Training from an s3:// cache by range requests does one GET per sample on the loader's threads, while the
training loop, host-bound for a small drafter, runs Python on the main thread. A client that runs Python
per request (fsspec/s3fs: its event loop, aiobotocore's signing and parsing) takes the GIL from that loop;
one that makes the request in native code with the GIL released (obstore: Rust) should not. The loop is a
counter (`n += 1`) or one-element torch ops (`--loop launcher`: each releases and retakes the GIL, as kernel
launches do); its rate alone and beside `--readers` threads of one client is the measure, the readers getting
ranges of one object (`--object-mb`) from moto's S3 server (its own process, reached directly, not through
the tests' relay). `--rate` paces the readers to that many GETs/s in all (0: as fast as they go), so that
the clients put the same load on the server (training asks for the GETs its batches need).
Per client: the loop's rate as a fraction of alone; the fractions of its wall time it was blocked (waiting
for the GIL) and runnable without a core (Linux schedstat; on a busy box a GIL hand-off shows partly as the
latter); GETs/s; client CPU ms per GET (this process's CPU time minus the loop thread's) and the part of it
in Python threads (the most the client can have held the GIL). The rounds alternate the clients; medians.
Clients: `s3fs` and `obstore` through dflash's `open_storage` (DFLASH_S3_CLIENT), `boto3` (get_object with
a Range) for reference; obstore only when installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash.shards.storage import open_storage

from tests.common.s3 import S3Server

Read = Callable[[int, int], bytes]


def _schedstat(task: str = "thread-self") -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting for one) of a thread, from Linux's schedstat; (0, 0) elsewhere."""
    path = f"/proc/{task}/schedstat" if task == "thread-self" else f"/proc/self/task/{task}/schedstat"
    try:
        with open(path) as f:
            on_cpu, queued, _ = f.read().split()
    except (OSError, ValueError):
        return 0, 0
    return int(on_cpu), int(queued)


def _python_threads_cpu_ns() -> int:
    """CPU ns of this process's Python threads but the calling one (readers, fsspec's event loop): an upper
    bound on the time the client held the GIL; a native client's own threads (obstore's Rust runtime) are
    not Python threads."""
    me = threading.get_native_id()
    return sum(
        _schedstat(str(t.native_id))[0] for t in threading.enumerate() if t.native_id not in (None, me)
    )


def count(seconds: float, launcher: bool = False) -> dict[str, float]:
    """A tight loop for `seconds`: iterations per second, this thread's CPU seconds, and the fractions of the
    wall time it waited for a core (runnable) and was blocked (not runnable: waiting for the GIL). The loop
    is `n += 1` (pure Python: gives the GIL up only when asked) or, with `launcher`, a one-element torch op
    (releases and retakes the GIL each time, as a training loop's kernel launches do)."""
    import torch

    a = torch.zeros(1)
    n, (cpu0, queued0), start = 0, _schedstat(), time.perf_counter()
    end = start + seconds
    while True:
        if launcher:
            for _ in range(100):
                a.add_(1)
            n += 100
        else:
            for _ in range(1000):
                n += 1
        if time.perf_counter() >= end:
            break
    wall, (cpu1, queued1) = time.perf_counter() - start, _schedstat()
    cpu, queued = (cpu1 - cpu0) / 1e9, (queued1 - queued0) / 1e9
    return {
        "counter": n / wall,
        "cpu_s": cpu,
        "queued": queued / wall,
        "gil": max(0.0, wall - cpu - queued) / wall,
    }


def beside(
    read: Read | None,
    seconds: float,
    readers: int,
    chunk: int,
    size: int,
    rate: float,
    launcher: bool = False,
) -> dict:
    """The counter alone (read None) or beside `readers` threads calling `read` (paced to `rate` GETs/s)."""
    if read is None:
        return count(seconds, launcher) | {"gets": 0.0, "cpu_ms": 0.0, "py_ms": 0.0}
    stop, done = threading.Event(), [0] * readers

    def loop(t: int) -> None:
        rng, next_at = random.Random(t), time.perf_counter()
        while not stop.is_set():
            if rate:
                next_at += readers / rate
                if (wait := next_at - time.perf_counter()) > 0:
                    time.sleep(wait)
            offset = rng.randrange(0, size - chunk)
            if len(read(offset, chunk)) != chunk:
                raise AssertionError("short read")
            done[t] += 1

    pool = [threading.Thread(target=loop, args=(t,), daemon=True) for t in range(readers)]
    for thread in pool:
        thread.start()
    time.sleep(0.3)  # connections made
    before, c0, py0, start = sum(done), time.process_time(), _python_threads_cpu_ns(), time.perf_counter()
    counted = count(seconds, launcher)
    gets, cpu, wall = sum(done) - before, time.process_time() - c0, time.perf_counter() - start
    python_ms = (_python_threads_cpu_ns() - py0) / 1e6
    stop.set()
    for thread in pool:
        thread.join()
    per_get = 1 / max(gets, 1)
    return counted | {
        "gets": gets / wall,
        "cpu_ms": 1e3 * (cpu - counted["cpu_s"]) * per_get,
        "py_ms": python_ms * per_get,
    }


def _spin(seconds: float, n: int) -> bytes:
    """Hold the GIL for `seconds` of CPU in Python, as a client that did its work in Python would."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass
    return bytes(n)


def clients(server: S3Server, bucket: str) -> dict[str, Read]:
    """name -> read(offset, size) of the object `o`, each client reading as dflash would."""
    import boto3

    out: dict[str, Read] = {}
    names = ["s3fs"]
    if importlib.util.find_spec("obstore"):
        names.append("obstore")
    else:
        print("obstore not installed: measuring s3fs and boto3 only")
    for name in names:
        os.environ["DFLASH_S3_CLIENT"] = name
        storage = open_storage(f"s3://{bucket}")
        assert storage.read_client == {"s3fs": "fsspec"}.get(name, name)
        out[name] = (lambda s: lambda off, n: s.read_range("o", off, n))(storage)
    os.environ.pop("DFLASH_S3_CLIENT")
    b3 = boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1")
    out["boto3"] = lambda off, n: b3.get_object(Bucket=bucket, Key="o", Range=f"bytes={off}-{off + n - 1}")[
        "Body"
    ].read()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--range-kb", default="100,1024", help="range sizes, KiB, comma-separated")
    p.add_argument("--readers", type=int, default=4, help="reader threads")
    p.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rate", type=float, default=0.0, help="GETs/s of all readers together (0: unpaced)")
    p.add_argument("--object-mb", type=int, default=4, help="moto copies the whole object for each GET")
    p.add_argument("--loop", choices=("counter", "launcher"), default="counter", help="the loop measured")
    p.add_argument(
        "--spin-ms",
        type=float,
        default=0.0,
        help="also a calibration client 'spin': this many ms of pure Python per read, no request",
    )
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # the launcher's ops on its own thread only
    size = args.object_mb << 20
    with tempfile.TemporaryDirectory() as work:
        server = S3Server.start(Path(work))
        try:
            bucket = server.bench_bucket()  # direct: the relay's Python threads would be measured too
            server.client().put_object(Bucket=bucket, Key="o", Body=os.urandom(size))
            reads = clients(server, bucket)
            if args.spin_ms:
                reads["spin"] = lambda off, n: _spin(args.spin_ms / 1e3, n)
            for kb in (int(x) for x in args.range_kb.split(",")):
                chunk = kb << 10
                for read in reads.values():
                    read(0, chunk)  # first connection, credentials
                runs: dict[str, list[dict]] = {name: [] for name in ("alone", *reads)}
                for _ in range(args.rounds):
                    for name in runs:
                        runs[name].append(
                            beside(
                                reads.get(name),
                                args.seconds,
                                args.readers,
                                chunk,
                                size,
                                args.rate,
                                args.loop == "launcher",
                            )
                        )
                alone = statistics.median(r["counter"] for r in runs["alone"])
                paced = f"paced to {args.rate:g} GETs/s" if args.rate else "unpaced"
                print(
                    f"{kb} KiB ranges, {args.readers} readers, {paced}, {args.loop}; medians of {args.rounds} rounds"
                )
                print(
                    f"{'client':8s} {'loop/s':>12s} {'vs alone':>9s} {'GIL wait':>9s} {'core wait':>10s} "
                    f"{'GETs/s':>8s} {'client CPU ms/GET':>18s} {'in Python threads':>18s}"
                )
                for name, results in runs.items():
                    med = {k: statistics.median(r[k] for r in results) for k in results[0]}
                    print(
                        f"{name:8s} {med['counter']:12,.0f} {med['counter'] / alone:9.2f} {med['gil']:9.0%} "
                        f"{med['queued']:10.0%} {med['gets']:8.1f} "
                        f"{med['cpu_ms']:18.2f} {med['py_ms']:18.2f}"
                    )
        finally:
            server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
