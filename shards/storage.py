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

Every remote request goes through `retries.retrying`: transient errors are retried with backoff and counted,
any other is raised at once as one line.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from .atomic import atomic_write_bytes, fsync_dir
from .errors import ShardError
from .retries import count_request, retrying
from .safe_io import open_regular, read_regular
from .storage_obstore import ObstoreReads, s3_client
from .urls import check_url, is_url, local_path, scheme

# one attempt per request: `retries.retrying` does the retrying, and counts it
_S3_CLIENT = {"connect_timeout": 10, "read_timeout": 120, "retries": {"max_attempts": 1}}


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

        count_request("head")
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

        count_request("list")
        return retrying(listing, self.where(prefix))

    def read_range(self, key: str, offset: int, size: int) -> bytes:
        if size == 0:
            return b""
        count_request("get", size)
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
        if self._reads is not None:
            retrying(lambda: self._reads.get_file(key, local), self.where(key))
        else:
            retrying(lambda: self.fs.get_file(self._key(key), str(local)), self.where(key))
        # its bytes too: a whole shard, where a range read is one sample's
        count_request("get", local.stat().st_size)

    def put(self, key: str, data: bytes) -> None:
        count_request("put", len(data))
        retrying(lambda: self.fs.pipe_file(self._key(key), data), self.where(key))

    def put_file(self, key: str, local: Path) -> None:
        count_request("put", local.stat().st_size)
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

        count_request("head")
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

        count_request("put", len(data))
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
