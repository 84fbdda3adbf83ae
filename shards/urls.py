"""What a location argument is: a local path or a URL, and a URL nothing here can serve refused in one line.

    is_url(text)              `scheme://...`
    check_url(url, flag)      the URL when fsspec can serve it (s3fs for s3://), else one line (ValueError)
    local_path(text, flag)    a local path; a URL (file:// aside) refused in one line, so no folder named
                              `s3:` is ever created by a command that takes only paths
    default_local_dir(url)    where a remote cache's local copies go; default_stage_dir: where one is built
A URL that carries credentials (`s3://key:secret@bucket`) is refused: they would be printed and recorded.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.S)
_CREDENTIALS_IN_URL = re.compile(r"^[^/@]*@")


def scheme(url: str) -> str:
    m = _URL.match(url)
    assert m is not None
    return m.group(1).lower()


def is_url(text: str | os.PathLike) -> bool:
    return isinstance(text, str) and _URL.match(text) is not None


def check_url(url: str, flag: str = "") -> str:
    """`url` when fsspec can serve it, else one line naming what is wrong (ValueError)."""
    label = f"{flag} {url}" if flag else url
    kind, rest = scheme(url), _URL.match(url).group(2)  # type: ignore[union-attr]
    if _CREDENTIALS_IN_URL.match(rest):
        raise ValueError(
            f"{flag or 'the location'}: credentials inside a URL are refused (they would be printed and "
            "recorded); set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE instead"
        )
    if kind == "file":
        return url
    try:
        import fsspec
    except ImportError:  # pragma: no cover - a base dependency
        raise ValueError(f"{label}: object storage needs fsspec (pip install fsspec s3fs)") from None
    try:
        fsspec.get_filesystem_class(kind)
    except ValueError:
        raise ValueError(
            f"{label}: unknown URL scheme {kind!r}: give a local path, s3://bucket/prefix or another "
            "fsspec URL"
        ) from None
    except ImportError as exc:
        raise ValueError(f"{label}: {kind}:// needs a package that is not installed ({exc})") from None
    if not rest.strip("/"):
        raise ValueError(f"{label}: names no bucket or path")
    return url


def local_path(text: str | os.PathLike, flag: str) -> Path:
    """`text` as a local path; a URL is refused in one line (no folder named `s3:` is ever created)."""
    if is_url(str(text)):
        url = str(text)
        if scheme(url) == "file":
            return Path(_URL.match(url).group(2))  # type: ignore[union-attr]
        raise ValueError(
            f"{flag} {url}: takes a local path, not a URL (object storage is not supported here)"
        )
    return Path(text)


def default_local_dir(location: str, base: str | os.PathLike | None = None) -> Path:
    """One directory per cache URL under `base` (default `$XDG_CACHE_HOME/dflash/remote`), named by a hash:
    the URL never becomes a path, and two caches never share one (their shard names are the same)."""
    if base is None:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash" / "remote"
    return Path(base) / hashlib.sha256(location.encode()).hexdigest()[:20]


def default_stage_dir(url: str) -> Path:
    return default_local_dir(url).with_name(default_local_dir(url).name + "-stage")
