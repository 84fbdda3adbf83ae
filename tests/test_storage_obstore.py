"""The obstore read path of s3:// caches (`shards/storage_obstore.py`) against a real S3 server (moto's:
`common/s3.py`): the same bytes, errors and retry counts as fsspec/s3fs, the same endpoint and credentials."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from dflash.shards import retries, storage
from dflash.shards.errors import ShardError
from dflash.shards.remote_cache import RemoteFile
from dflash.shards.retries import request_counts, transient_counts
from dflash.shards.storage import open_storage

pytest.importorskip("obstore")
CLIENTS = {"s3fs": "fsspec", "obstore": "obstore"}  # DFLASH_S3_CLIENT -> read_client


@pytest.fixture
def obj(s3) -> tuple[str, bytes]:
    bucket, data = s3.new_bucket(), os.urandom(300_001)
    s3.client().put_object(Bucket=bucket, Key="c/shards/o", Body=data)
    return f"s3://{bucket}/c", data


def _open(url: str, client: str, monkeypatch) -> storage.RemoteStorage:
    monkeypatch.setenv("DFLASH_S3_CLIENT", client)
    opened = open_storage(url)
    assert opened.read_client == CLIENTS[client]
    return opened


def _generic(detail: str) -> Exception:
    from obstore.exceptions import GenericError

    return GenericError(f"Generic S3 error: Error performing GET http://127.0.0.1:1/b/k in 3ms - {detail}")


@pytest.mark.parametrize(
    ("detail", "kind"),
    [
        (
            "Server returned non-2xx status code: 503 Service Unavailable: <Error><Code>SlowDown</Code>",
            "throttled",
        ),
        (
            "Server returned non-2xx status code: 500 Internal Server Error: <Error><Code>InternalError</Code>",
            "server_error",
        ),
        ("Server returned non-2xx status code: 502 Bad Gateway: ", "server_error"),
        ("HTTP error: error sending request\n\nDebug source:\n  kind: Connect", "connection"),
        ("HTTP error: operation timed out\n  kind: Timeout", "timeout"),
        ("Server returned non-2xx status code: 400 Bad Request: <Error><Code>InvalidArgument</Code>", None),
    ],
)
def test_obstore_errors_are_sorted_as_s3fs_errors(detail: str, kind: str | None) -> None:
    """The retry rules see obstore's errors as they see botocore's: the same kinds counted, the rest raised."""
    from dflash.shards.storage_obstore import _builtin_error

    assert retries._transient_kind(_builtin_error(_generic(detail))) == kind


def test_both_clients_read_the_same_bytes_and_count_the_same(obj, monkeypatch, tmp_path: Path) -> None:
    url, data = obj
    got = {}
    for client in CLIENTS:
        remote = _open(url, client, monkeypatch)
        before = request_counts()
        ranges = [remote.read_range("shards/o", off, n) for off, n in ((0, 1), (7, 100_000), (299_990, 11))]
        after = request_counts()
        assert after["get"] - before.get("get", 0) == 3
        assert after["get_bytes"] - before.get("get_bytes", 0) == 100_012
        remote.get_file("shards/o", tmp_path / client)
        got[client] = (ranges, (tmp_path / client).read_bytes(), remote.read_all("shards/o", 1 << 20))
    assert got["s3fs"] == got["obstore"]
    assert got["obstore"] == ([data[:1], data[7:100_007], data[299_990:]], data, data)


def test_missing_key_and_short_read_give_the_same_one_line_errors(obj, monkeypatch) -> None:
    url, _ = obj
    errors: dict[str, list[str]] = {}
    for client in CLIENTS:
        remote = _open(url, client, monkeypatch)
        with pytest.raises(FileNotFoundError) as missing:
            remote.read_range("shards/none", 0, 10)
        shard = RemoteFile(remote, "shards/o")
        with pytest.raises(ShardError) as short:
            shard.pread(100, 300_000)  # 1 byte left
        with pytest.raises(OSError) as past:
            shard.pread(100, 300_001)  # none left: the server's 416
        errors[client] = [str(e.value) for e in (missing, short, past)]
    assert errors["obstore"] == errors["s3fs"]
    assert errors["obstore"][0] == f"{url}/shards/none: not found"
    assert (
        errors["obstore"][1].endswith("got 1: truncated")
        and "range is not satisfiable" in errors["obstore"][2]
    )
    assert all("\n" not in e for e in errors["obstore"])


def test_obstore_reads_are_retried_and_counted_while_the_server_is_down(obj, s3, monkeypatch) -> None:
    url, data = obj
    remote = _open(url, "obstore", monkeypatch)
    monkeypatch.setattr(retries, "BACKOFF_S", 0.05)
    before = transient_counts()
    s3.down()
    back = threading.Timer(0.4, s3.up)
    back.start()
    try:
        assert remote.read_range("shards/o", 5, 1000) == data[5:1005]
    finally:
        back.join()
    after = transient_counts()
    assert after["connection"] > before.get("connection", 0)
    assert after["retries"] - before.get("retries", 0) == after["connection"] - before.get("connection", 0)
    s3.down()  # down for good: one line naming the object after the attempts
    try:
        started = time.monotonic()
        with pytest.raises(
            OSError, match=r"/shards/o: still failing after 6 attempts \(connection: "
        ) as info:
            remote.read_range("shards/o", 0, 10)
        assert "\n" not in str(info.value) and time.monotonic() - started < 10
    finally:
        s3.up()


def test_endpoint_and_credentials_come_from_the_profile_as_s3fs_reads_them(
    obj, s3, monkeypatch, tmp_path: Path
) -> None:
    """No AWS_* variable but AWS_PROFILE: the profile's endpoint and keys (botocore's rules) are obstore's."""
    url, data = obj
    (tmp_path / "config").write_text(f"[profile bench]\nregion = us-east-1\nendpoint_url = {s3.endpoint}\n")
    (tmp_path / "credentials").write_text(
        f"[bench]\naws_access_key_id = {s3.env['AWS_ACCESS_KEY_ID']}\n"
        f"aws_secret_access_key = {s3.env['AWS_SECRET_ACCESS_KEY']}\n"
    )
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_PROFILE", "bench")
    monkeypatch.setenv("AWS_ENDPOINT", "http://127.0.0.1:9")  # obstore's own name, not botocore's: ignored
    assert _open(url, "obstore", monkeypatch).read_range("shards/o", 3, 50) == data[3:53]


def test_an_assumed_role_is_asked_of_botocore_once_not_per_read(obj, s3, monkeypatch, tmp_path: Path) -> None:
    """A profile that assumes a role (moto's STS): refreshable credentials, handed to obstore by a provider
    that obstore asks again only when they are due, not per request."""
    from dflash.shards import storage_obstore

    url, data = obj
    keys = f"aws_access_key_id = {s3.env['AWS_ACCESS_KEY_ID']}\naws_secret_access_key = {s3.env['AWS_SECRET_ACCESS_KEY']}"
    (tmp_path / "config").write_text(
        f"[profile base]\nregion = us-east-1\nendpoint_url = {s3.endpoint}\n{keys}\n"
        f"[profile reader]\nregion = us-east-1\nendpoint_url = {s3.endpoint}\n"
        "role_arn = arn:aws:iam::123456789012:role/reader\nsource_profile = base\n"
    )
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_PROFILE", "reader")
    asked = []
    provide = storage_obstore._Refreshing.__call__
    monkeypatch.setattr(
        storage_obstore._Refreshing, "__call__", lambda self: asked.append(1) or provide(self)
    )
    remote = _open(url, "obstore", monkeypatch)
    assert [remote.read_range("shards/o", off, 10) for off in (0, 10, 20)] == [
        data[0:10],
        data[10:20],
        data[20:30],
    ]
    assert len(asked) == 1


def test_choice_of_client_and_fallback(obj, monkeypatch, tmp_path: Path) -> None:
    url, _ = obj
    monkeypatch.delenv("DFLASH_S3_CLIENT", raising=False)
    assert open_storage(url).read_client == "obstore"  # auto: obstore when installed
    monkeypatch.setenv("DFLASH_S3_CLIENT", "curl")
    with pytest.raises(ValueError, match=r"^DFLASH_S3_CLIENT='curl': expected one of auto, s3fs, obstore$"):
        open_storage(url)
    # No credentials anywhere obstore can be given them: s3fs's own rules decide (here: refused).
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("DFLASH_S3_CLIENT", "obstore")
    assert open_storage(url).read_client == "fsspec"
