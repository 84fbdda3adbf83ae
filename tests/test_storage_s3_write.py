"""Writing caches to object storage (a real S3 server: `common/s3.py`): extract -> verify -> convert -> train
-> export on s3://, the commit protocol (shards before the manifest), one writer per prefix, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dflash.extract.cli import main as extract_main
from dflash.shards import Cache
from dflash.tools.shards_cli import main as shards_main
from dflash.train.cli import main as train_main

from tests.common.extract import tiny_rows, write_dataset
from tests.common.targets import make_target
from tests.common.train_cli import tiny_train_argv


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("s3w")
    return {"target": make_target(root, "qwen3"), "dataset": write_dataset(root, tiny_rows(16, max_len=24))}


def extract_argv(inputs: dict[str, Path], out: str | Path, stage: Path) -> list[str]:
    paths = ["--target", str(inputs["target"]), "--dataset", str(inputs["dataset"]), "--out", str(out)]
    return [*paths, "--stage-dir", str(stage), "--device", "cpu", "--layers", "1,2", "--json"]


@pytest.fixture(autouse=True)
def _local_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def test_extract_verify_convert_train_export_on_s3(s3, inputs, tmp_path: Path, capsys) -> None:
    bucket = s3.new_bucket()
    url, q4 = f"s3://{bucket}/caches/lossless", f"s3://{bucket}/caches/q4"
    assert extract_main(extract_argv(inputs, url, tmp_path / "stage")) == 0
    keys = s3.keys(bucket, "caches/lossless/")
    manifest = json.loads(
        s3.client().get_object(Bucket=bucket, Key="caches/lossless/manifest.json")["Body"].read()
    )
    assert manifest["complete"] and manifest["shards"]
    for shard in manifest["shards"]:
        assert keys[f"caches/lossless/shards/{shard['name']}"] == shard["bytes"]
    assert "caches/lossless/.lock" not in keys and "caches/lossless/target/frozen.safetensors" in keys
    assert list((tmp_path / "stage" / "shards").glob("shard-*")) == []  # staging keeps no uploaded shard
    assert not Path("s3:").exists()
    capsys.readouterr()
    assert shards_main(["verify", url]) == 0
    assert (
        shards_main(["convert", url, "--codec", "q4", "--out", q4, "--stage-dir", str(tmp_path / "s2")]) == 0
    )
    assert f"verify {q4}`" in capsys.readouterr().out
    assert shards_main(["verify", q4, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]
    run = tmp_path / "run"
    argv = tiny_train_argv(q4, run, "--max-steps", "3", "--eval-every", "3", "--no-tensorboard", "--no-plots")  # type: ignore[arg-type]
    assert train_main(argv) == 0
    assert train_main(["export", str(run), "--out", str(tmp_path / "export")]) == 0
    # No credential in anything written: manifests, metrics, checkpoints, staging and local copies, outputs.
    secrets = [s3.env["AWS_ACCESS_KEY_ID"].encode(), s3.env["AWS_SECRET_ACCESS_KEY"].encode()]
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(written) > 10 and not [p for p in written if any(k in p.read_bytes() for k in secrets)]
    out = capsys.readouterr()
    assert not any(k.decode() in out.out + out.err for k in secrets)
    # A re-run of the same command on the complete prefix does nothing and says so.
    assert extract_main(extract_argv(inputs, url, tmp_path / "other-stage")) == 0
    assert "already a complete cache" in capsys.readouterr().err  # --json: stdout stays JSON


def test_second_writer_is_refused_in_one_line(s3, inputs, tmp_path: Path, capsys) -> None:
    from dflash.shards.publish import RemoteLock
    from dflash.shards.storage import open_storage

    bucket = s3.new_bucket()
    url = f"s3://{bucket}/c"
    holder = RemoteLock(open_storage(url), "another dflash-extract on another node").acquire()
    try:
        assert extract_main(extract_argv(inputs, url, tmp_path / "stage")) == 2
    finally:
        holder.release()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "being written by another process" in err and "another node" in err
    assert s3.keys(bucket) == {}  # nothing written by the refused writer
    assert extract_main(extract_argv(inputs, url, tmp_path / "stage")) == 0  # released: it runs


def test_lock_of_a_dead_writer_on_this_host_is_taken_over(s3, tmp_path: Path) -> None:
    import socket
    import subprocess

    from dflash.shards.publish import RemoteLock
    from dflash.shards.storage import open_storage

    storage = open_storage(f"s3://{s3.new_bucket()}/c")
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = {"host": socket.gethostname(), "pid": dead.pid, "what": "killed", "started": 0, "renewed": 9e12}
    storage.put(".lock", json.dumps(stale).encode())
    lock = RemoteLock(storage, "resume").acquire()
    assert json.loads(storage.read_all(".lock", 4096))["what"] == "resume"
    lock.release()
    assert storage.size(".lock") is None


def test_shards_go_up_before_the_manifest_names_them(s3, inputs, tmp_path: Path, monkeypatch) -> None:
    """Every manifest the server ever held names only shard objects already there, whole."""
    from dflash.shards import storage as storage_mod

    bucket = s3.new_bucket()
    seen: list[str] = []
    real_put = storage_mod.RemoteStorage.put

    def checking_put(self, key: str, data: bytes) -> None:
        if key == "manifest.json":
            m = json.loads(data)
            up = self.list_sizes("shards")
            for shard in m["shards"]:
                assert up.get(shard["name"]) == shard["bytes"], shard
            seen.append("complete" if m["complete"] else "incomplete")
        real_put(self, key, data)

    monkeypatch.setattr(storage_mod.RemoteStorage, "put", checking_put)
    assert extract_main(extract_argv(inputs, f"s3://{bucket}/c", tmp_path / "stage")) == 0
    assert seen and seen[-1] == "complete"
    with Cache.open(f"s3://{bucket}/c", local_dir=tmp_path / "read") as cache:
        assert cache.manifest.complete and cache.shard_file_problems() == {}


def test_takeover_replaces_only_the_version_judged_stale_and_a_robbed_writer_stops(s3, monkeypatch) -> None:
    import socket
    import time

    from dflash.shards import publish
    from dflash.shards.publish import PrefixLocked, RemoteLock
    from dflash.shards.storage import open_storage

    storage = open_storage(f"s3://{s3.new_bucket()}/c")
    stale = {"host": "elsewhere", "pid": 1, "what": "old", "started": 0, "renewed": time.time() - 3600}
    storage.put(".lock", json.dumps(stale).encode())
    old = storage.etag(".lock")
    winner = RemoteLock(storage, "winner").acquire()
    assert not storage.replace_if(".lock", b"{}", old)  # a second taker holding the old version loses
    with pytest.raises(PrefixLocked, match="being written by another process"):
        RemoteLock(storage, "second").acquire()  # the winner's lock is fresh and its process runs
    # The winner's lease is taken over behind its back (as after a long pause): its next renewal sees it.
    monkeypatch.setattr(publish, "LEASE_RENEW_S", 0.05)
    winner._stop.set()
    winner._thread.join()
    winner._stop.clear()
    thief = {
        "host": socket.gethostname() + "-other",
        "pid": 2,
        "what": "thief",
        "started": 1,
        "renewed": time.time(),
    }
    storage.put(".lock", json.dumps(thief).encode())
    winner._renew()
    assert winner.lost
    with pytest.raises(PrefixLocked, match="took the lock over"):
        winner.check()
    winner.release()
    assert json.loads(storage.read_all(".lock", 4096))["what"] == "thief"  # the thief's lock is left alone


def test_dry_run_to_s3_sizes_the_staging_directory(inputs, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    argv = [*extract_argv(inputs, "s3://bucket/cache", tmp_path / "stage"), "--dry-run"]
    assert extract_main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["publish_to"] == "s3://bucket/cache" and d["fits"] is True
    assert list(tmp_path.iterdir()) == []  # nothing written, no folder named s3:, no request made


@pytest.mark.parametrize("url", ["s3x://bucket/cache", "gs://bucket/cache"])
def test_unservable_out_url_is_refused_not_written_as_a_folder(
    inputs, url: str, tmp_path: Path, capsys, monkeypatch
) -> None:
    """Before object storage, `--out s3://bucket/cache` extracted into a local folder named `s3:` and exited 0."""
    monkeypatch.chdir(tmp_path)
    argv = [
        "--target",
        str(inputs["target"]),
        "--dataset",
        str(inputs["dataset"]),
        "--out",
        url,
        "--device",
        "cpu",
    ]
    assert extract_main([*argv, "--layers", "1,2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and url in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
