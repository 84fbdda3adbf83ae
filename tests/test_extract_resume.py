"""SIGKILL an extraction at random moments, resume it each time: the result equals an uninterrupted run."""

from __future__ import annotations

import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
from dflash.shards.cache import Cache
from dflash.shards.manifest import load_manifest
from dflash.shards.reader import ShardReader
from dflash.shards.verify import verify_cache

from tests.common.extract import Launcher, reference_setup, shard_bytes, tiny_rows

UNIT_BYTES = 6 << 10  # ~20 shards for this dataset: kills land inside and between shard commits
DELAY_S = 0.03  # per batch, so a run lasts long enough for kills to land mid-run


def committed_shards_are_whole(cache: Path) -> None:
    for p in (cache / "shards").glob("shard-*.dfs"):
        with ShardReader.open(p) as reader:
            assert reader.verify() == [], p


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    paths, result = reference_setup(
        tmp_path_factory.mktemp("resume"),
        tiny_rows(160, seed=3, max_len=48),
        rows_per_batch=50,
        unit_bytes=UNIT_BYTES,
    )
    assert result.complete and result.units_total >= 10
    return paths


def test_sigkill_at_random_moments_then_resume(setup: dict) -> None:
    rng = random.Random(1234)
    out = setup["root"] / "killed"
    log = str(setup["root"] / "children.log")
    spec = {**setup["spec"], "out": str(out)}
    launcher = Launcher()
    shards = out / "shards"
    total = len(list((setup["reference"] / "shards").iterdir()))

    def committed() -> int:
        return len(list(shards.glob("shard-*.dfs"))) if shards.is_dir() else 0

    try:
        kills, attempts, mid_run = 0, 0, 0
        while kills < 10:
            attempts += 1
            assert attempts <= 30, f"only {kills} kills landed before completion in {attempts} attempts"
            pid = launcher.run(spec, delay=DELAY_S, log=log)
            # Kill at a random moment: some during start-up (lock, manifest, target parts), most after a
            # random number of further shards, a random fraction of a batch later (mid-shard, mid-commit).
            if rng.random() < 0.25:
                time.sleep(rng.uniform(0.0, 0.5))
            else:
                goal = rng.randint(min(committed(), total - 1), total - 1)  # a kill may follow the last shard
                deadline = time.monotonic() + 60
                while committed() < goal and launcher.poll(pid) is None and time.monotonic() < deadline:
                    time.sleep(0.005)
                time.sleep(rng.uniform(0.0, 2 * DELAY_S))
            code = launcher.poll(pid)
            if code is None:
                os.kill(pid, signal.SIGKILL)
                # an exit between the poll and the kill leaves an unreaped child: the kill lands, its code stays
                code = launcher.wait(pid)
            if code != -signal.SIGKILL:  # finished before the kill: start a fresh cache, try again
                assert code == 0, Path(log).read_text()[-3000:]
                shutil.rmtree(out)
                continue
            kills += 1
            if shards.is_dir():
                committed_shards_are_whole(out)
                mid_run += 0 < committed() < total

        # The kills hit real work, not only start-up or the final manifest write.
        assert mid_run >= 3, f"only {mid_run} of {kills} kills landed between the first and the last shard"

        pid = launcher.run(spec, log=log)
        assert launcher.wait(pid) == 0, Path(log).read_text()[-3000:]
    finally:
        launcher.close()
    assert load_manifest(out).complete
    assert shard_bytes(out) == shard_bytes(setup["reference"])  # same samples, same content, same order
    assert not [p for p in (out / "shards").iterdir() if p.name.startswith(".")]
    with Cache.open(out) as cache:
        report = verify_cache(cache, dataset_rows=160)
        assert report.ok, report.lines()
    assert load_manifest(out).to_dict() == load_manifest(setup["reference"]).to_dict()


def test_sigkill_while_a_commit_is_in_flight_then_resume(setup: dict) -> None:
    """Killed while a finished shard waits for its fsync + rename (and the next one streams): that shard is
    not visible, the resume redoes it, the result equals an uninterrupted run."""
    out = setup["root"] / "killed-commit"
    marker = setup["root"] / "publishing"
    log = str(setup["root"] / "children-commit.log")
    spec = {**setup["spec"], "out": str(out)}
    launcher = Launcher()
    try:
        pid = launcher.run(spec, delay=DELAY_S, publish_delay=60.0, marker=str(marker), log=log)
        deadline = time.monotonic() + 60
        while not marker.exists() and launcher.poll(pid) is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert marker.exists(), Path(log).read_text()[-3000:]
        time.sleep(4 * DELAY_S)  # the writer streams the next unit meanwhile
        os.kill(pid, signal.SIGKILL)
        assert launcher.wait(pid) == -signal.SIGKILL
        in_flight = marker.read_text()
        assert not (out / "shards" / in_flight).exists()
        temps = [p for p in (out / "shards").iterdir() if p.name.startswith(f".{in_flight}.tmp-")]
        assert len(temps) == 1 and temps[0].read_bytes().endswith(b"DFSFOOT1")  # finished, never published
        committed_shards_are_whole(out)
        pid = launcher.run(spec, log=log)
        assert launcher.wait(pid) == 0, Path(log).read_text()[-3000:]
    finally:
        launcher.close()
    assert shard_bytes(out) == shard_bytes(setup["reference"])
    with Cache.open(out) as cache:
        assert verify_cache(cache, dataset_rows=160).ok
