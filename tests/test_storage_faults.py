"""Faults on object storage (a real S3 server behind a relay the tests cut: `common/s3.py`): extraction and
training SIGKILLed and resumed, the server gone mid-upload, transient errors retried and counted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from dflash.shards import Cache
from dflash.shards.retries import transient_counts
from dflash.shards.verify import verify_cache

from tests.common.extract import make_config, reference_setup, shard_bytes, tiny_rows

REPO = Path(__file__).resolve().parents[1]
UNIT_BYTES = 6 << 10  # several shards for this dataset
# An extraction child as the command line runs it (`run_config`), each batch slowed so a kill lands mid-run.
_EXTRACT_CHILD = textwrap.dedent("""
    import json, sys, time
    from dflash.extract import stages
    step = stages.GpuStep.__call__
    def slow(self, item):
        time.sleep(0.15)
        return step(self, item)
    stages.GpuStep.__call__ = slow
    from dflash.extract.cli import run_config
    from tests.common.extract import make_config
    spec = json.loads(sys.argv[1])
    sys.exit(run_config(make_config(spec.pop("target"), spec.pop("dataset"), spec.pop("out"), **spec)))
""")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    paths, result = reference_setup(
        tmp_path_factory.mktemp("s3faults"), tiny_rows(60, seed=3, max_len=40), rows_per_batch=20,
        unit_bytes=UNIT_BYTES,
    )  # fmt: skip
    assert result.complete and result.units_total >= 4
    return paths


@pytest.fixture(autouse=True)
def _local_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash.shards import publish

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(publish, "PUBLISH_EVERY_S", 0.05)  # shards go up while the (tiny) run works


def _spec(setup: dict, out: str, stage: Path) -> dict:
    spec = {k: v for k, v in setup["spec"].items() if k != "json"}
    return {**spec, "out": out, "stage_dir": str(stage), "json": True}


def _remote_shards(url: str, local: Path) -> dict[str, bytes]:
    """The shard bytes of a complete remote cache, read back through the reader (checksums checked)."""
    with Cache.open(url, local_dir=local) as cache:
        assert cache.manifest.complete and cache.shard_file_problems() == {}
        assert verify_cache(cache).ok
        return {n: cache.storage.read_all(f"shards/{n}", 1 << 30) for n in cache.shard_names}


def _wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.slow
def test_extraction_sigkill_then_resume_equals_uninterrupted(s3, setup: dict, tmp_path: Path) -> None:
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/c"
    spec = _spec(setup, url, tmp_path / "stage")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", _EXTRACT_CHILD, json.dumps(spec)], env=env, cwd=REPO)
    try:

        def started() -> bool:
            keys = s3.keys(bucket)
            return "c/manifest.json" in keys and any(k.startswith("c/shards/") for k in keys)

        _wait_for(lambda: started() or child.poll() is not None)
        assert child.poll() is None, "finished before the kill"
        child.send_signal(signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL
    finally:
        child.kill()
    keys = s3.keys(bucket)
    assert "c/.lock" in keys  # left by the killed writer: the resume takes it over (its pid is gone)
    manifest = (
        s3.client().get_object(Bucket=bucket, Key="c/manifest.json")["Body"].read()
        if "c/manifest.json" in keys
        else b"{}"
    )
    assert not json.loads(manifest).get("complete")
    with Cache.open(url, require_complete=False, local_dir=tmp_path / "midway") as cache:  # readable as it is
        assert cache.shard_names and verify_cache(cache).lines() == [
            f"{url}: cache is incomplete (manifest complete=false): extraction unfinished"
        ]
    from dflash.extract.cli import run_config

    assert run_config(make_config(**{**spec, "unit_bytes": UNIT_BYTES})) == 0  # the same command again
    assert _remote_shards(url, tmp_path / "read") == shard_bytes(setup["reference"])
    assert "c/.lock" not in s3.keys(bucket)


def test_resume_on_another_node_without_the_staging_directory(
    s3, setup: dict, tmp_path: Path, capsys
) -> None:
    """The killed writer's staging directory is gone (another node): the shards up there are kept (read back
    through their indexes), only the missing one is extracted again."""
    from dflash.extract.cli import run_config

    bucket = s3.new_bucket()
    url = f"s3://{bucket}/c"
    first = _spec(setup, url, tmp_path / "stage-a")
    assert run_config(make_config(**{**first, "unit_bytes": UNIT_BYTES})) == 0
    s3.client().put_object(
        Bucket=bucket,
        Key="c/manifest.json",
        Body=(tmp_path / "stage-a" / "manifest.json")
        .read_bytes()
        .replace(b'"complete": true', b'"complete": false'),
    )
    s3.client().delete_object(Bucket=bucket, Key="c/shards/shard-000001.dfs")
    other = make_config(**{**_spec(setup, url, tmp_path / "stage-b"), "unit_bytes": UNIT_BYTES})
    capsys.readouterr()
    assert run_config(other) == 0
    assert json.loads(capsys.readouterr().out)["units_done"] == 1
    assert _remote_shards(url, tmp_path / "read") == shard_bytes(setup["reference"])
    changed = make_config(
        **{**_spec(setup, url, tmp_path / "stage-c"), "unit_bytes": UNIT_BYTES, "max_len": 16}
    )
    s3.client().put_object(Bucket=bucket, Key="c/manifest.json", Body=b"x")  # a resume reads it: not JSON
    from dflash.shards.errors import ShardError

    with pytest.raises(ShardError, match=r"manifest\.json: not valid JSON"):
        run_config(changed)


def test_server_gone_mid_upload_is_retried_and_counted(
    s3, setup: dict, tmp_path: Path, monkeypatch, capsys
) -> None:
    """An outage after the first shard object, lasting until the run has retried: every request retried with
    backoff, the run completes."""
    from dflash.extract import stages
    from dflash.extract.cli import run_config

    bucket = s3.new_bucket()
    url = f"s3://{bucket}/c"
    step = stages.GpuStep.__call__
    before = transient_counts().get("retries", 0)
    cut = threading.Event()

    def end_outage_once_retried() -> None:
        _wait_for(lambda: transient_counts().get("retries", 0) > before)
        time.sleep(0.5)
        s3.up()

    # The server goes down from inside the forward, while outputs are still to be written (a thread watching
    # the bucket could see the first shard only after the last one, under load), and comes back only once a
    # request has failed and been retried.
    def cut_after_first_shard(self, item):
        time.sleep(0.1)
        if not cut.is_set() and any(k.startswith("c/shards/") for k in s3.keys(bucket)):
            s3.down()
            cut.set()
            threading.Thread(target=end_outage_once_retried, daemon=True).start()
        return step(self, item)

    monkeypatch.setattr(stages.GpuStep, "__call__", cut_after_first_shard)
    config = make_config(**{**_spec(setup, url, tmp_path / "stage"), "unit_bytes": UNIT_BYTES, "json": False})
    try:
        assert run_config(config) == 0
    finally:
        s3.up()
    assert cut.is_set()
    assert "requests retried (connection: " in capsys.readouterr().out
    assert transient_counts().get("retries", 0) > before
    assert _remote_shards(url, tmp_path / "read") == shard_bytes(setup["reference"])


@pytest.mark.slow
def test_server_gone_for_good_fails_in_one_line_then_resume_completes(
    s3, setup: dict, tmp_path: Path, monkeypatch, capsys
) -> None:
    from dflash.extract import stages
    from dflash.extract.cli import run_config
    from dflash.shards import retries
    from dflash.shards.cli import run_main

    monkeypatch.setattr(retries, "BACKOFF_S", 0.02)  # six attempts in ~1 s
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/c"
    config = make_config(**{**_spec(setup, url, tmp_path / "stage"), "unit_bytes": UNIT_BYTES})
    step = stages.GpuStep.__call__

    cut = threading.Event()

    def cut_after_first_shard(self, item):
        time.sleep(0.1)
        if not cut.is_set() and any(k.startswith("c/shards/") for k in s3.keys(bucket)):
            s3.down()
            cut.set()
        return step(self, item)

    monkeypatch.setattr(stages.GpuStep, "__call__", cut_after_first_shard)
    try:
        rc = run_main(lambda _: run_config(config), None, "dflash-extract")
    finally:
        s3.up()
    lines = capsys.readouterr().err.strip().splitlines()
    assert cut.is_set()
    assert rc == 2 and lines[-1].startswith("dflash-extract: error: ") and "still failing after" in lines[-1]
    assert "Traceback" not in "\n".join(lines)
    keys = s3.keys(bucket)
    assert any(k.startswith("c/shards/") for k in keys)
    if "c/manifest.json" in keys:  # whatever went up names only whole shards: never the complete manifest
        body = s3.client().get_object(Bucket=bucket, Key="c/manifest.json")["Body"].read()
        assert not json.loads(body)["complete"]
    monkeypatch.setattr(stages.GpuStep, "__call__", step)
    assert run_config(config) == 0  # the same command, the server back: it completes
    assert _remote_shards(url, tmp_path / "read") == shard_bytes(setup["reference"])


@pytest.mark.slow
def test_training_sigkill_then_resume_from_s3_reproduces_the_losses(s3, tmp_path: Path) -> None:
    from dflash.train.cli import main as train_main
    from dflash.train.metrics import read_metrics

    from tests.common.fake_cache import write_fake_cache
    from tests.common.s3 import upload_dir
    from tests.common.train_cli import tiny_train_argv, train_killed_at, train_resumed

    local = write_fake_cache(tmp_path / "cache", num_samples=24, samples_per_shard=6)
    bucket = s3.new_bucket()
    upload_dir(s3, bucket, "c", local)
    flags = ["--max-steps", "6", "--save-every", "3", "--eval-every", "3", "--log-every", "1", "--no-tensorboard",
             "--no-plots", "--epochs", "10"]  # fmt: skip
    assert train_main(tiny_train_argv(local, tmp_path / "reference", *flags)) == 0
    run = tmp_path / "run"
    argv = tiny_train_argv(f"s3://{bucket}/c", run, *flags)  # type: ignore[arg-type]
    train_killed_at(argv, 4)
    assert [r["step"] for r in read_metrics(run)][-1] == 4
    train_resumed(argv)

    def trajectory(path: Path) -> list[tuple]:
        return [(r["step"], r["loss"], r["lr"], r["grad_norm"], r.get("tau")) for r in read_metrics(path)]

    assert trajectory(run) == trajectory(tmp_path / "reference")  # bit for bit, local disk vs s3 + a kill


def test_resume_refused_when_ranks_see_different_checkpoints(tmp_path: Path) -> None:
    """Nodes without a shared filesystem each read their own run directory: a node that lacks rank 0's latest
    checkpoint must not start from another step (or from scratch) while the others resume."""
    from types import SimpleNamespace

    from dflash.train.trainer import Trainer

    def ranks_see(steps: list[float], mine: Path | None, rank: int) -> None:
        fake = SimpleNamespace(
            info=SimpleNamespace(world_size=len(steps), rank=rank),
            run_dir=tmp_path,
            reduce_sum=lambda values: [sum(steps), sum(s * s for s in steps)],
        )
        Trainer._same_checkpoint_everywhere(fake, mine)  # type: ignore[arg-type]

    step_6 = tmp_path / "checkpoints" / "step_000006"
    ranks_see([6.0, 6.0, 6.0, 6.0], step_6, 0)  # every node has it: fine
    ranks_see([-1.0, -1.0], None, 1)  # a fresh run everywhere: fine
    with pytest.raises(
        ValueError, match=r"rank 1 finds no checkpoint in .*copy its run directory to every node"
    ):
        ranks_see([6.0, -1.0, 6.0, 6.0], None, 1)
    with pytest.raises(ValueError, match="rank 0 finds step 6"):
        ranks_see([6.0, 3.0], step_6, 0)
