"""Several processes (RANK/WORLD_SIZE env, no process group) write one cache; resume with another world size."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from dflash.extract.units import LOCK_NAME, CacheLocked, RankInfo, RunLocks
from dflash.shards.cache import Cache
from dflash.shards.manifest import load_manifest
from dflash.shards.verify import verify_cache

from tests.common.extract import Launcher, reference_setup, shard_bytes, tiny_rows

UNIT_BYTES = 6 << 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    paths, result = reference_setup(
        tmp_path_factory.mktemp("multi"),
        tiny_rows(80, seed=4, max_len=40),
        rows_per_batch=30,
        unit_bytes=UNIT_BYTES,
    )
    assert result.complete and result.units_total >= 4
    launcher = Launcher()
    yield {**paths, "launcher": launcher}
    launcher.close()


def _results(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def test_two_processes_write_one_cache(setup: dict) -> None:
    launcher, out = setup["launcher"], setup["root"] / "two"
    logs = [setup["root"] / f"rank{r}.log" for r in range(2)]
    pids = [
        launcher.run(
            {**setup["spec"], "out": str(out)},
            env={"RANK": str(r), "WORLD_SIZE": "2", "DFLASH_RUN_ID": "a"},
            log=str(logs[r]),
        )
        for r in (1, 0)  # rank 1 first: it must wait for rank 0 to prepare the cache
    ]
    codes = [launcher.wait(pid) for pid in pids]
    assert codes == [0, 0], [p.read_text()[-3000:] for p in logs]
    assert _results(logs[1]) == []  # only rank 0 reports
    (r0,) = _results(logs[0])
    assert r0["complete"] and 0 < r0["units_done"] < r0["units_total"]  # rank 1 did the rest
    assert shard_bytes(out) == shard_bytes(setup["reference"])
    assert load_manifest(out).to_dict() == load_manifest(setup["reference"]).to_dict()
    with Cache.open(out) as cache:
        assert verify_cache(cache, dataset_rows=80).ok


def test_world_size_change_on_resume(setup: dict) -> None:
    """Kill a 2-process run midway, resume with 3 processes: one complete, identical cache."""
    launcher, out = setup["launcher"], setup["root"] / "resized"
    log = str(setup["root"] / "resized.log")
    pids = [
        launcher.run(
            {**setup["spec"], "out": str(out)},
            delay=0.05,
            env={"RANK": str(r), "WORLD_SIZE": "2", "DFLASH_RUN_ID": "b"},
            log=log,
        )
        for r in (0, 1)
    ]
    deadline = time.monotonic() + 60
    while not list((out / "shards").glob("shard-*.dfs")) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        launcher.wait(pid)
    assert not load_manifest(out).complete
    pids = [
        launcher.run(
            {**setup["spec"], "out": str(out)},
            env={"RANK": str(r), "WORLD_SIZE": "3", "DFLASH_RUN_ID": "c"},
            log=log,
        )
        for r in (0, 1, 2)
    ]
    assert [launcher.wait(pid) for pid in pids] == [0, 0, 0], Path(log).read_text()[-3000:]
    assert shard_bytes(out) == shard_bytes(setup["reference"])
    assert load_manifest(out).complete


def test_rank_waits_only_for_its_own_run(tmp_path: Path) -> None:
    """A rank of another launch (other world size) refuses to join the rank 0 that holds the cache."""
    rank0 = RunLocks(tmp_path, RankInfo(rank=0, world_size=2, run_id="x"))
    rank0.acquire()
    rank0.mark_ready()
    try:
        # fcntl locks are per process: probe from a child that holds nothing.
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                other = RunLocks(tmp_path, RankInfo(rank=1, world_size=3, run_id="x"))
                other.acquire()
                try:
                    other.wait_for_rank0(timeout=0.5)
                except CacheLocked as exc:
                    code = 0 if "different run" in str(exc) else 2
            finally:
                os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0
        assert (tmp_path / LOCK_NAME).is_file()
    finally:
        rank0.release()
