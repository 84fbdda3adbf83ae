"""Where a cache lives: a local directory or an object-storage prefix (`s3://bucket/prefix`, any fsspec URL).

    open_storage(location) -> Storage   a URL (checked by `urls.check_url`) or a local directory
    Storage: size, listing, range reads, whole-object reads, atomic puts, conditional create, delete

Local storage keeps the behaviour every local cache had before (`atomic.py`: temp, fsync, rename). Remote
storage goes through fsspec (s3fs for s3://): an object PUT is atomic (readers see the old object, the new one
or none, never a torn one), and `create_exclusive` is a PUT with `If-None-Match: *`, refused when the key
exists: the lock of a second writer. The endpoint and credentials come from where boto reads them
(`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`, `AWS_PROFILE`, `~/.aws/config`); a URL that
carries credentials itself is refused, so none is ever printed or recorded. The per-sample range reads and
whole-shard downloads of s3:// go through obstore when it is installed (`storage_obstore.py`: outside the GIL).

Transient remote errors (5xx, throttling, timeouts, dropped connections) are retried with exponential backoff
(`RETRIES` attempts) and counted (`transient_counts`), for the metrics; any other error is raised at once as
one line (a wrong credential: PermissionError; a missing key: FileNotFoundError).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from .atomic import atomic_write_bytes, fsync_dir
from .errors import ShardError
from .safe_io import open_regular, read_regular
from .storage_obstore import ObstoreReads, s3_client
from .urls import check_url, is_url, local_path, scheme

T = TypeVar("T")
RETRIES = 6
BACKOFF_S = 0.2  # first wait; doubles per attempt, capped at 5 s
_TRANSIENT_CODES = {
    "500", "502", "503", "504", "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
    "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable", "RequestLimitExceeded",
}  # fmt: skip
_S3_CLIENT = {"connect_timeout": 10, "read_timeout": 120, "retries": {"max_attempts": 1}}
_counts_lock = threading.Lock()
_counts: Counter[str] = Counter()
_requests: Counter[str] = Counter()


def transient_counts() -> dict[str, int]:
    """Retried remote errors by kind since the process started (`retries` counts every retry)."""
    with _counts_lock:
        return dict(_counts)


def request_counts() -> dict[str, int]:
    """Remote requests made since the process started, by kind, and the bytes they moved (for benchmarks)."""
    with _counts_lock:
        return dict(_requests)


def _request(kind: str, nbytes: int = 0) -> None:
    with _counts_lock:
        _requests[kind] += 1
        if nbytes:
            _requests[f"{kind}_bytes"] += nbytes


def merge_counts(transient: Mapping[str, int], requests: Mapping[str, int]) -> None:
    """Add counts another process made on this one's behalf (a training loader's worker), so this process's
    metrics and benchmarks include them."""
    with _counts_lock:
        _counts.update(transient)
        _requests.update(requests)


def storage_retries() -> dict[str, dict[str, int]]:
    """`{"storage_retries": transient_counts()}` once a request was retried, else {} (a metrics record's part)."""
    counts = transient_counts()
    return {"storage_retries": counts} if counts else {}


def _count(kind: str) -> None:
    with _counts_lock:
        _counts[kind] += 1
        _counts["retries"] += 1


def _transient_kind(exc: BaseException) -> str | None:
    """A short name for an error worth retrying, None for one that is not (a credential, a missing key)."""
    if isinstance(exc, (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError)):
        return None
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ConnectionError):
        return "connection"
    name = type(exc).__name__
    if name in {"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
                "ServerDisconnectedError", "ClientConnectorError", "ClientOSError", "ClientPayloadError",
                "ResponseStreamingError", "IncompleteReadError"}:  # fmt: skip
        return "connection"
    code = ""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", "")) or str(
            response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")
        )
    if code in _TRANSIENT_CODES:
        return "throttled" if "Slow" in code or "Throttl" in code or "Limit" in code else "server_error"
    if isinstance(exc, OSError) and exc.errno in (errno.EIO, errno.EAGAIN, errno.EBUSY, errno.ETIMEDOUT):
        return "server_error"
    text = str(exc)
    if any(
        c in text for c in ("SlowDown", "503", "500 ", "InternalError", "ServiceUnavailable", "timed out")
    ):
        return "server_error"
    cause = exc.__cause__ or exc.__context__
    return _transient_kind(cause) if cause is not None and cause is not exc else None


def retrying(op: Callable[[], T], what: str, *, attempts: int = RETRIES) -> T:
    """`op()`, retried with backoff on transient errors (counted); the last error is one line naming `what`."""
    for attempt in range(attempts):
        try:
            return op()
        except Exception as exc:
            kind = _transient_kind(exc)
            if kind is None:
                raise _one_line(exc, what) from None
            if attempt == attempts - 1:
                raise OSError(
                    errno.EIO, f"{what}: still failing after {attempts} attempts ({kind}: {_first_line(exc)})"
                ) from None
            _count(kind)
            time.sleep(min(BACKOFF_S * 2**attempt, 5.0))
    raise AssertionError


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


def _one_line(exc: Exception, what: str) -> Exception:
    text = _first_line(exc)
    if isinstance(exc, PermissionError) or any(
        k in text for k in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "Access Key Id")
    ):
        return PermissionError(
            f"{what}: access refused by the storage service ({text}); check AWS_ACCESS_KEY_ID/"
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE and AWS_ENDPOINT_URL"
        )
    if isinstance(exc, FileNotFoundError):
        return FileNotFoundError(f"{what}: not found")
    if isinstance(exc, FileExistsError):
        return FileExistsError(f"{what}: already exists")
    if isinstance(exc, (ShardError, ValueError)):
        return exc
    return OSError(f"{what}: {text}")


class Storage:
    """A cache root: keys are relative '/'-separated names (`manifest.json`, `shards/shard-000000.dfs`)."""

    location: str  # the root as given (a path or a URL), for messages

    def where(self, key: str) -> str:
        return f"{self.location.rstrip('/')}/{key}"

    def size(self, key: str) -> int | None:
        """The object's size in bytes, None when there is none."""
        raise NotImplementedError

    def list_sizes(self, prefix: str) -> dict[str, int]:
        """name -> size of the objects directly under `prefix` (a folder key)."""
        raise NotImplementedError

    def read_range(self, key: str, offset: int, size: int) -> bytes:
        raise NotImplementedError

    def read_all(self, key: str, max_bytes: int) -> bytes:
        raise NotImplementedError

    def get_file(self, key: str, local: Path) -> None:
        """Copy the object into the local file `local` (streamed)."""
        local.write_bytes(self.read_all(key, 1 << 62))

    def put(self, key: str, data: bytes) -> None:
        """Replace the object whole: readers see the old content or the new, never a mix."""
        raise NotImplementedError

    def put_file(self, key: str, local: Path) -> None:
        """`put` of a local file's content (large shards stream, not held in memory, on remote storage)."""
        self.put(key, local.read_bytes())

    def create_exclusive(self, key: str, data: bytes) -> bool:
        """Create the object only if no object has the key; False when one does (another writer's lock)."""
        raise NotImplementedError

    def etag(self, key: str) -> str | None:
        """The object's version tag (changes whenever it is rewritten), None when there is none."""
        raise NotImplementedError

    def replace_if(self, key: str, data: bytes, etag: str) -> bool:
        """Replace the object only if it is still the version `etag` (`If-Match`); False when it is not."""
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError

    @property
    def is_remote(self) -> bool:
        return False


class LocalStorage(Storage):
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.location = str(root)

    def _path(self, key: str) -> Path:
        return self.root / key

    def size(self, key: str) -> int | None:
        try:
            return os.stat(self._path(key)).st_size
        except FileNotFoundError:
            return None

    def list_sizes(self, prefix: str) -> dict[str, int]:
        d = self._path(prefix)
        if not d.is_dir():
            return {}
        return {p.name: p.stat().st_size for p in d.iterdir() if p.is_file()}

    def read_range(self, key: str, offset: int, size: int) -> bytes:
        fd = open_regular(self._path(key))
        try:
            return os.pread(fd, size, offset)
        finally:
            os.close(fd)

    def read_all(self, key: str, max_bytes: int) -> bytes:
        return read_regular(self._path(key), max_bytes)

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)

    def create_exclusive(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(path.parent)
        return True

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


class RemoteStorage(Storage):
    """An fsspec filesystem under one URL prefix; every call retried on transient errors."""

    def __init__(self, url: str):
        import fsspec

        self.location = check_url(url)
        options: dict = {"skip_instance_cache": True}  # the environment (endpoint, credentials) read now
        if scheme(url) in ("s3", "s3a"):  # retried here, once per attempt, so that every retry is counted
            options["config_kwargs"] = _S3_CLIENT
        self.fs, root = fsspec.core.url_to_fs(url, **options)
        if hasattr(self.fs, "retries"):
            self.fs.retries = 1
        self.root = root.rstrip("/")
        self._reads: ObstoreReads | None = None  # per-sample and per-shard reads, outside the GIL
        if scheme(url) in ("s3", "s3a") and s3_client() == "obstore":
            bucket, _, prefix = self.root.partition("/")
            self._reads = ObstoreReads.open(bucket, prefix)

    @property
    def read_client(self) -> str:
        """What `read_range` and `get_file` go through: 'obstore' or 'fsspec' (DFLASH_S3_CLIENT)."""
        return "fsspec" if self._reads is None else "obstore"

    @property
    def is_remote(self) -> bool:
        return True

    def _key(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def size(self, key: str) -> int | None:
        def stat() -> int | None:
            try:
                info = self.fs.info(self._key(key))
            except FileNotFoundError:
                return None
            return int(info["size"]) if info.get("type") != "directory" else None

        _request("head")
        return retrying(stat, self.where(key))

    def list_sizes(self, prefix: str) -> dict[str, int]:
        def listing() -> dict[str, int]:
            try:
                entries = self.fs.ls(self._key(prefix), detail=True, refresh=True)
            except FileNotFoundError:
                return {}
            return {
                e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
                for e in entries
                if e.get("type") == "file"
            }

        _request("list")
        return retrying(listing, self.where(prefix))

    def read_range(self, key: str, offset: int, size: int) -> bytes:
        if size == 0:
            return b""
        _request("get", size)
        if self._reads is not None:
            return retrying(lambda: self._reads.read_range(key, offset, size), self.where(key))
        return retrying(
            lambda: self.fs.cat_file(self._key(key), start=offset, end=offset + size), self.where(key)
        )

    def read_all(self, key: str, max_bytes: int) -> bytes:
        size = self.size(key)
        if size is None:
            raise FileNotFoundError(f"{self.where(key)}: not found")
        if size > max_bytes:
            raise ShardError(f"{self.where(key)}: {size} bytes, more than the {max_bytes} allowed")
        return self.read_range(key, 0, size)

    def get_file(self, key: str, local: Path) -> None:
        _request("get")
        if self._reads is not None:
            retrying(lambda: self._reads.get_file(key, local), self.where(key))
        else:
            retrying(lambda: self.fs.get_file(self._key(key), str(local)), self.where(key))

    def put(self, key: str, data: bytes) -> None:
        _request("put", len(data))
        retrying(lambda: self.fs.pipe_file(self._key(key), data), self.where(key))

    def put_file(self, key: str, local: Path) -> None:
        _request("put", local.stat().st_size)
        retrying(lambda: self.fs.put_file(str(local), self._key(key)), self.where(key))

    def create_exclusive(self, key: str, data: bytes) -> bool:
        def create() -> bool:
            try:
                self.fs.pipe_file(self._key(key), data, IfNoneMatch="*")
            except FileExistsError:
                return False
            return True

        return retrying(create, self.where(key))

    def etag(self, key: str) -> str | None:
        def tag() -> str | None:
            try:
                return self.fs.info(self._key(key), refresh=True).get("ETag")
            except FileNotFoundError:
                return None

        _request("head")
        return retrying(tag, self.where(key))

    def replace_if(self, key: str, data: bytes, etag: str) -> bool:
        def replace() -> bool:
            try:
                self.fs.pipe_file(self._key(key), data, IfMatch=etag)
            except (FileNotFoundError, FileExistsError):
                return False
            except OSError as exc:  # s3fs: EINVAL "At least one of the pre-conditions ... did not hold"
                if exc.errno == errno.EINVAL or "pre-condition" in str(exc):
                    return False
                raise
            return True

        _request("put", len(data))
        return retrying(replace, self.where(key))

    def delete(self, key: str) -> None:
        def remove() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self._key(key))

        retrying(remove, self.where(key))


def open_storage(location: str | os.PathLike) -> Storage:
    """The storage of a cache root: a URL (checked) or a local directory."""
    text = str(location)
    if is_url(text) and scheme(text) != "file":
        return RemoteStorage(text)
    return LocalStorage(local_path(text, "the location") if is_url(text) else Path(location))
