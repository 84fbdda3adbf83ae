"""Remote requests' retries and counters, for every storage client (`storage.RemoteStorage`, obstore's reads).

Transient remote errors (5xx, throttling, timeouts, dropped connections) are retried with exponential backoff
(`RETRIES` attempts) and counted (`transient_counts`), for the metrics; any other error is raised at once as
one line (a wrong credential: PermissionError; a missing key: FileNotFoundError). Requests and their bytes are
counted too (`request_counts`, for benchmarks); a training loader's worker processes send theirs to the
trainer (`merge_counts`).
"""

from __future__ import annotations

import errno
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TypeVar

from .errors import ShardError

T = TypeVar("T")
RETRIES = 6
BACKOFF_S = 0.2  # first wait; doubles per attempt, capped at 5 s
_TRANSIENT_CODES = {
    "500", "502", "503", "504", "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
    "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable", "RequestLimitExceeded",
}  # fmt: skip
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


def count_request(kind: str, nbytes: int = 0) -> None:
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
