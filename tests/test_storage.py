"""`shards/storage.py`, `shards/retries.py` and `shards/urls.py` without a server: retries, error lines, URL rules, local storage."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError
from dflash.shards import retries
from dflash.shards.retries import retrying, transient_counts
from dflash.shards.storage import LocalStorage
from dflash.shards.urls import check_url, is_url, local_path


@pytest.fixture(autouse=True)
def _fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retries, "BACKOFF_S", 0.0)


def _client_error(code: str, status: int) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Op"
    )


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (_client_error("SlowDown", 503), "throttled"),
        (_client_error("InternalError", 500), "server_error"),
        (EndpointConnectionError(endpoint_url="http://x"), "connection"),
        (TimeoutError("read timed out"), "timeout"),
        (OSError(errno.EIO, "5xx from s3fs"), "server_error"),
    ],
)
def test_transient_errors_are_retried_and_counted(error: Exception, kind: str) -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise error
        return "ok"

    before = transient_counts()
    assert retrying(flaky, "s3://b/k") == "ok" and len(calls) == 3
    after = transient_counts()
    assert after[kind] - before.get(kind, 0) == 2 and after["retries"] - before.get("retries", 0) == 2


def test_persistent_transient_error_is_one_line_after_the_attempts() -> None:
    with pytest.raises(OSError, match=r"s3://b/k: still failing after 6 attempts \(throttled: ") as info:
        retrying(lambda: (_ for _ in ()).throw(_client_error("SlowDown", 503)), "s3://b/k")
    assert "\n" not in str(info.value) and info.value.strerror.startswith("s3://b/k: still failing")


@pytest.mark.parametrize(
    ("error", "expected", "text"),
    [
        (PermissionError("Forbidden"), PermissionError, "access refused by the storage service"),
        (_client_error("InvalidAccessKeyId", 403), PermissionError, "AWS_ACCESS_KEY_ID"),
        (FileNotFoundError("nope"), FileNotFoundError, "s3://b/k: not found"),
        (_client_error("NoSuchBucket", 404), OSError, "s3://b/k: "),
    ],
)
def test_other_errors_are_not_retried(error: Exception, expected: type, text: str) -> None:
    calls = []

    def failing() -> None:
        calls.append(1)
        raise error

    with pytest.raises(expected, match=text):
        retrying(failing, "s3://b/k")
    assert len(calls) == 1


def test_url_rules() -> None:
    assert is_url("s3://b/p") and not is_url("cache/s3:") and not is_url(Path("s3://b"))  # type: ignore[arg-type]
    assert check_url("s3://bucket/prefix", "--cache") == "s3://bucket/prefix"
    assert check_url("memory://x/y") == "memory://x/y"
    for url, message in [
        ("nope://b/c", "unknown URL scheme 'nope'"),
        ("s3://", "names no bucket or path"),
        ("s3://AKIA:secret@b/c", "credentials inside a URL are refused"),
    ]:
        with pytest.raises(ValueError, match=message) as info:
            check_url(url, "--out")
        assert "secret" not in str(info.value).replace("AWS_SECRET", "")
    assert local_path("file:///tmp/x", "--out") == Path("/tmp/x")
    with pytest.raises(ValueError, match=r"--out s3://b/run: takes a local path, not a URL"):
        local_path("s3://b/run", "--out")


def test_local_storage_is_atomic_and_exclusive(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    assert store.create_exclusive(".lock", b"a") and not store.create_exclusive(".lock", b"b")
    assert store.read_all(".lock", 10) == b"a"
    store.put("shards/x", b"0123456789")
    assert store.read_range("shards/x", 3, 4) == b"3456" and store.list_sizes("shards") == {"x": 10}
    assert [p.name for p in (tmp_path / "shards").iterdir()] == ["x"]  # no temp file left behind
    store.delete("shards/x")
    assert store.size("shards/x") is None and store.list_sizes("nothing") == {}


def test_published_ledger_survives_a_line_cut_short(tmp_path: Path) -> None:
    from dflash.shards.manifest import ShardInfo
    from dflash.shards.paths import committed_shard_names
    from dflash.shards.published import LEDGER_NAME, published_shards, record_published

    def info(unit: int) -> ShardInfo:
        return ShardInfo(
            name=f"shard-{unit:06d}.dfs", rows=2, tokens=9, bytes=100 + unit, index_checksum="0" * 16
        )

    record_published(tmp_path, "shard-000000.dfs", info(0), [{"row": 4, "reason": "nonfinite"}])
    with open(tmp_path / LEDGER_NAME, "ab") as f:
        f.write(b'{"name": "shard-000001.dfs", "info": {"na')  # a crash in the middle of an append
    record_published(tmp_path, "shard-000002.dfs", info(2), [])
    got = published_shards(tmp_path)
    assert sorted(got) == ["shard-000000.dfs", "shard-000002.dfs"]
    assert got["shard-000000.dfs"]["skipped"] == [{"row": 4, "reason": "nonfinite"}]
    assert got["shard-000002.dfs"]["info"].bytes == 102
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "shard-000001.dfs").write_bytes(b"x")
    assert committed_shard_names(tmp_path) == ["shard-000000.dfs", "shard-000001.dfs", "shard-000002.dfs"]
