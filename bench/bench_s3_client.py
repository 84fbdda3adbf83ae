"""fsspec/s3fs (dflash's fsspec path) against obstore: range GETs from moto's S3 server on a free local port.

    python bench/bench_s3_client.py --object-mb 64 --range-kb 1024 --requests 300 --threads 1,8

Reports, per client and reader-thread count, MB/s and the client's CPU seconds per GB (the process's CPU time:
the server runs in its own process). obstore (called directly here; dflash's own obstore path: bench_s3_gil.py) is
measured when installed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash.shards.storage import open_storage

from tests.common.s3 import S3Server


def run(read, threads: int, requests: int, object_size: int, chunk: int) -> dict:
    offsets = [(i * 7919 * chunk) % (object_size - chunk) for i in range(requests)]
    t0, c0 = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(threads) as pool:
        got = sum(pool.map(lambda off: len(read(off, chunk)), offsets))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"mb_per_s": got / wall / 1e6, "cpu_s_per_gb": cpu / (got / 1e9)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--object-mb", type=int, default=64)
    p.add_argument("--range-kb", type=int, default=1024)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--threads", default="1,8")
    args = p.parse_args()
    size, chunk = args.object_mb << 20, args.range_kb << 10
    with tempfile.TemporaryDirectory() as work:
        server = S3Server.start(Path(work))
        try:
            bucket = server.bench_bucket()  # direct: the fault tests' relay would cap the rate
            server.client().put_object(Bucket=bucket, Key="o", Body=os.urandom(size))
            os.environ["DFLASH_S3_CLIENT"] = "s3fs"  # dflash's fsspec path (auto would take obstore)
            clients = {"s3fs": open_storage(f"s3://{bucket}").read_range}
            clients["s3fs"] = (lambda read: lambda off, n: read("o", off, n))(clients["s3fs"])
            try:
                import obstore
                from obstore.store import S3Store

                store = S3Store(bucket, endpoint=server.endpoint, allow_http=True, region="us-east-1")
                clients["obstore"] = lambda off, n: bytes(
                    obstore.get_range(store, "o", start=off, end=off + n)
                )
            except ImportError:
                print("obstore not installed: measuring s3fs only")
            for name, read in clients.items():
                for t in (int(x) for x in args.threads.split(",")):
                    read(0, chunk)  # connect
                    r = run(read, t, args.requests, size, chunk)
                    print(
                        f"{name:>8} {t:>2} threads: {r['mb_per_s']:7.1f} MB/s, {r['cpu_s_per_gb']:6.2f} client CPU-s/GB"
                    )
        finally:
            server.close()


if __name__ == "__main__":
    main()
