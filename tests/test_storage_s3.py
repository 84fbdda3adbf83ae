"""Caches on object storage: read through a real S3 server (moto's, in a subprocess: `common/s3.py`)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from common.synth import make_cache
from dflash.shards import Cache
from dflash.shards.errors import ShardError
from dflash.shards.retries import request_counts
from dflash.shards.storage import open_storage
from dflash.tools.shards_cli import main as shards_main

from tests.common.s3 import upload_dir, uploaded


@pytest.fixture(scope="module")
def local_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("s3src") / "cache"
    make_cache(
        path, [5, 60, 7, 300, 2], layers=(2, 5), hidden=64, rows_per_shard=3, skipped=((1, "too long"),)
    )
    return path


@pytest.fixture
def remote_cache(s3, local_cache: Path) -> str:
    return uploaded(s3, local_cache, "caches/a")


def _json(capsys: pytest.CaptureFixture[str], argv: list[str], rc: int = 0) -> dict:
    assert shards_main(argv) == rc
    return json.loads(capsys.readouterr().out)


def test_inspecting_commands_read_s3_as_local(
    remote_cache: str, local_cache: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for command in (
        ["info"],
        ["ls"],
        ["show", "3"],
        ["stats", "--sample", "3"],
        ["verify"],
        ["verify", "--quick"],
    ):
        local = _json(capsys, [command[0], str(local_cache), *command[1:], "--json"])
        remote = _json(capsys, [command[0], remote_cache, *command[1:], "--json"])
        for d in (local, remote):
            d.pop("path", None), d.pop("cache", None)
        assert remote == local, command
    assert (
        tmp_path / "xdg" / "dflash" / "remote"
    ).is_dir()  # manifest and target/ copied there, not into CWD
    assert not Path("s3:").exists()


def test_samples_read_by_range_equal_local(remote_cache: str, local_cache: Path, tmp_path: Path) -> None:
    with Cache.open(local_cache) as a, Cache.open(remote_cache, local_dir=tmp_path / "stage") as b:
        assert b.location == remote_cache and b.shard_file_problems() == {}
        for e in a.entries():
            x, y = a.read(e.row), b.read(e.row)
            assert x.input_ids.equal(y.input_ids) and x.loss_mask.equal(y.loss_mask)
            assert all(x.hidden[k].equal(y.hidden[k]) for k in x.hidden)
        sub = b.read(3, [5], dequantize=False)
        assert list(sub.hidden) == [5]


def test_corrupt_object_is_named_by_its_url(s3, remote_cache: str, tmp_path: Path, capsys) -> None:
    bucket, prefix = remote_cache[5:].split("/", 1)
    client = s3.client()
    key = f"{prefix}/shards/shard-000000.dfs"
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[20] ^= 0xFF  # inside the first sample's frames
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    d = _json(capsys, ["verify", remote_cache, "--json"], rc=1)
    assert not d["ok"] and any(
        f"{remote_cache}/shards/shard-000000.dfs: sample 0" in p for p in json.dumps(d).split('"')
    )
    client.delete_object(Bucket=bucket, Key=key)
    with Cache.open(remote_cache, local_dir=tmp_path / "stage") as cache:
        assert "missing, the manifest lists it" in cache.shard_file_problems()["shard-000000.dfs"]


@pytest.mark.parametrize(
    "argv",
    [
        ["info", "s3x://bucket/cache"],
        ["info", "gs:/"],
        ["info", "s3://key:secret@bucket/cache"],
        ["convert", "cache", "--codec", "q4", "--out", "gopher://host/x"],
    ],
)
def test_unsupported_urls_refused_in_one_line(argv: list[str], capsys, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert shards_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "secret" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def checking_server(tmp_path_factory: pytest.TempPathFactory, local_cache: Path):
    """A second server that checks credentials, holding one cache's manifest and target/ (no listing: moto
    5.2's auth refuses its own prefixed listings)."""
    from tests.common.s3 import S3Server

    server = S3Server.start(tmp_path_factory.mktemp("auth"), auth=True)
    client = server.client()
    client.create_bucket(Bucket="guarded")
    for path in [local_cache / "manifest.json", *(local_cache / "target").iterdir()]:
        client.upload_file(str(path), "guarded", f"c/{path.relative_to(local_cache).as_posix()}")
    yield server
    server.close()


@pytest.mark.parametrize(
    ("key", "secret"), [("AKIANOSUCHKEY0000000", "wrong-secret-123"), (None, "wrong-secret-123")]
)
def test_wrong_credentials_one_line(
    checking_server, key, secret, monkeypatch, capsys, tmp_path: Path
) -> None:
    for name, value in checking_server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "right"))
    with Cache.open("s3://guarded/c", require_complete=False) as cache:  # the right key reads it
        assert cache.manifest.complete
    if key is not None:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "wrong"))
    assert shards_main(["info", "s3://guarded/c"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "access refused by the storage service" in err, err
    assert "AWS_ACCESS_KEY_ID" in err and secret not in err and "Traceback" not in err
    assert list((tmp_path / "wrong").rglob("manifest.json")) == []
    for client in ("s3fs", "obstore") if importlib.util.find_spec("obstore") else ("s3fs",):
        monkeypatch.setenv("DFLASH_S3_CLIENT", client)  # a range read (training's) refused alike
        with pytest.raises(PermissionError, match="access refused by the storage service") as refused:
            open_storage("s3://guarded/c").read_range("manifest.json", 0, 10)
        assert "\n" not in str(refused.value) and secret not in str(refused.value)


@pytest.mark.parametrize(
    ("prog", "argv"),
    [
        ("extract", ["--target", "t", "--dataset", "d", "--out", "s3x://bucket/cache"]),
        ("extract", ["--target", "s3://bucket/target", "--dataset", "d", "--out", "c"]),
        ("train", ["--cache", "c", "--out", "s3://bucket/run"]),
        ("train", ["--cache", "nope://bucket/cache", "--out", "run"]),
        ("train", ["export", "run", "--out", "s3://bucket/export"]),
    ],
)
def test_url_flags_refused_in_one_line_and_no_folder(
    prog: str, argv: list[str], capsys, tmp_path, monkeypatch
) -> None:
    """`dflash-extract --out s3://...` used to exit 0 having written a local folder named `s3:`."""
    from dflash.extract.cli import main as extract_main
    from dflash.train.cli import main as train_main

    monkeypatch.chdir(tmp_path)
    assert (extract_main if prog == "extract" else train_main)(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


def _train_argv(cache: str | Path, run: Path) -> list[str]:
    from common.train_cli import tiny_train_argv

    return tiny_train_argv(
        cache, run, "--max-steps", "4", "--save-every", "2", "--eval-every", "2", "--no-tensorboard",
        "--no-plots", "--num-draft-layers", "2", "--target-layer-ids", "1,3", "--seed", "3",
    )  # fmt: skip


def test_training_from_s3_equals_training_from_disk(s3, tmp_path: Path, monkeypatch) -> None:
    from common.fake_cache import write_fake_cache
    from dflash.train import cli as train_cli
    from dflash.train.metrics import read_metrics

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    local = write_fake_cache(tmp_path / "cache", num_samples=30, samples_per_shard=10)
    bucket = s3.new_bucket()
    upload_dir(s3, bucket, "c", local)
    assert train_cli.main([*_train_argv(f"s3://{bucket}/c", tmp_path / "dry"), "--dry-run"]) == 0
    assert not (tmp_path / "dry").exists()  # every check of a run, against the bucket, nothing written
    assert train_cli.main(_train_argv(local, tmp_path / "run_local")) == 0
    clients = ("s3fs", "obstore") if importlib.util.find_spec("obstore") else ("s3fs",)
    for client in clients:  # range reads through each client (DFLASH_S3_CLIENT): the same batches
        monkeypatch.setenv("DFLASH_S3_CLIENT", client)
        assert train_cli.main(_train_argv(f"s3://{bucket}/c", tmp_path / f"run_{client}")) == 0
    monkeypatch.delenv("DFLASH_S3_CLIENT")
    losses = [
        [r.get("loss") for r in read_metrics(tmp_path / name) if "loss" in r]
        for name in ("run_local", *(f"run_{c}" for c in clients))
    ]
    assert all(run == losses[0] for run in losses[1:]) and len(losses[0]) == 4
    kept = tmp_path / "kept"  # whole shards kept on local disk: the same batches, later reads local
    argv = [*_train_argv(f"s3://{bucket}/c", tmp_path / "run_kept"), "--shard-cache-dir", str(kept)]
    assert train_cli.main([*argv, "--shard-cache-gb", "1"]) == 0
    assert [r.get("loss") for r in read_metrics(tmp_path / "run_kept") if "loss" in r] == losses[0]
    (copy,) = kept.iterdir()  # one directory per cache URL
    assert sorted(p.name for p in (copy / "shards").iterdir()) == sorted(
        p.name for p in (local / "shards").iterdir()
    )
    # Loader processes read the bucket too, sharing the run's shard directory: the same batches again
    procs = [*_train_argv(f"s3://{bucket}/c", tmp_path / "run_procs"), "--loader-workers", "2"]
    assert (
        train_cli.main([*procs, "--shard-cache-dir", str(tmp_path / "kept2"), "--shard-cache-gb", "1"]) == 0
    )
    assert [r.get("loss") for r in read_metrics(tmp_path / "run_procs") if "loss" in r] == losses[0]
    (copy,) = (tmp_path / "kept2").iterdir()
    assert len(list((copy / "shards").iterdir())) == len(list((local / "shards").iterdir()))
    assert train_cli.main(["export", str(tmp_path / "run_s3fs"), "--out", str(tmp_path / "export")]) == 0


def test_shard_file_cache_keeps_at_most_its_bound(
    remote_cache: str, local_cache: Path, tmp_path: Path
) -> None:
    sizes = sorted(p.stat().st_size for p in (local_cache / "shards").iterdir())
    bound = sizes[-1] + 1  # room for one shard at a time
    with Cache.open(remote_cache, local_dir=tmp_path / "c", shard_cache_bytes=bound) as cache:
        rows = [e.row for e in cache.entries()]
        first = {r: cache.read(r) for r in rows}
        kept = list((tmp_path / "c" / "shards").iterdir())
        assert len(kept) == 1 and sum(p.stat().st_size for p in kept) <= bound
        # the first shard opened is kept, the other read by ranges (`test_kept_shards.py`)
        assert (cache._shard_cache.misses, cache._shard_cache.remote) == (1, len(cache.shard_names) - 1)
    with Cache.open(local_cache) as plain:
        for r in rows:
            assert first[r].input_ids.equal(plain.read(r).input_ids)


def test_loader_workers_range_reads_count_in_the_training_process(s3, tmp_path: Path, monkeypatch) -> None:
    """A run's `storage_retries` and a benchmark's request counts are the training process's: its loader
    workers' requests are added to them, batch by batch."""
    from common.fake_cache import write_fake_cache
    from dflash.shards.retries import request_counts
    from dflash.train.data_spec import DataSpec
    from dflash.train.loader_procs import ProcessLoader

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    local = write_fake_cache(tmp_path / "cache", num_samples=30, samples_per_shard=10)
    bucket = s3.new_bucket()
    upload_dir(s3, bucket, "c", local)
    spec = DataSpec(layer_ids=[1, 3], block_size=4, mask_token_id=90, num_anchors=4, gamma=2.0, token_budget=96,
                    max_length=40, loader_workers=2, epochs=1)  # fmt: skip
    with Cache.open(f"s3://{bucket}/c") as cache:
        before = request_counts().get("get", 0)
        batches = list(ProcessLoader(cache, spec).iterate())
        samples = sum(len(b.rows) for b, _ in batches)
        assert samples == 30 and request_counts().get("get", 0) - before >= samples  # a range GET per sample


def test_opening_a_listed_shard_is_one_request_and_a_replaced_one_fails_in_one_line(
    s3, remote_cache: str, tmp_path: Path
) -> None:
    """A complete cache's manifest lists each shard's size: no HEAD per open, and a shard under 1 MiB comes in
    one GET (magic, index, footer); an object replaced by a shorter one or another shard fails as a corrupt
    shard."""
    bucket, prefix = remote_cache[5:].split("/", 1)
    client = s3.client()
    with Cache.open(remote_cache, local_dir=tmp_path / "stage") as cache:
        name = cache.shard_names[0]
        size = cache._listed[name].bytes
        before = request_counts()
        cache.shard(name)
        after = request_counts()
        moved = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
        assert moved == {"get": 1, "get_bytes": size}
        key = f"{prefix}/shards/{cache.shard_names[1]}"
        data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        other = client.get_object(Bucket=bucket, Key=f"{prefix}/shards/{name}")["Body"].read()
        assert len(other) != len(data)
        for replaced in (data[:-100], other):  # shorter; another shard (bytes past its size are never read)
            client.put_object(Bucket=bucket, Key=key, Body=replaced)
            where = rf"^{remote_cache}/shards/{cache.shard_names[1]}: "
            with (
                pytest.raises(ShardError, match=where) as e,
                Cache.open(remote_cache, local_dir=tmp_path / "stage") as again,
            ):
                again.shard(cache.shard_names[1])
            assert "\n" not in str(e.value)


def test_a_listed_shard_deleted_from_the_bucket_is_one_line_naming_it(
    s3, remote_cache: str, tmp_path: Path
) -> None:
    """With its size from the manifest, a shard's first request is a range read: a missing object still says so
    in one line naming its URL, as the HEAD did."""
    bucket, prefix = remote_cache[5:].split("/", 1)
    with Cache.open(remote_cache, local_dir=tmp_path / "stage") as cache:
        name = cache.shard_names[0]
        s3.client().delete_object(Bucket=bucket, Key=f"{prefix}/shards/{name}")
        with pytest.raises(FileNotFoundError, match=rf"^{remote_cache}/shards/{name}") as e:
            cache.shard(name)
        assert "\n" not in str(e.value)
