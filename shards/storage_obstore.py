"""Reads of s3:// objects through obstore, whose requests run in native code with the GIL released.

    s3_client() -> "s3fs" | "obstore"      what DFLASH_S3_CLIENT asks for (s3fs | obstore | auto, the default:
                                           obstore when it is installed)
    ObstoreReads.open(bucket, prefix)      the reader, or None (s3fs reads; the reason in a debug log)

Why: training from an s3:// cache by range requests does one GET per sample. Through fsspec/s3fs each costs
~3 ms of Python on the loader's threads (its event loop, aiobotocore's signing and parsing), which holds the
GIL the training loop needs; obstore (Rust) spends a fraction of that, mostly outside the GIL
(`bench/bench_s3_gil.py`). Only the per-sample and per-shard reads come here (`RemoteStorage.read_range`,
`get_file`); listing, HEAD, puts, the conditional writes of the writer's lock stay on s3fs.

Same place, same identity: the endpoint, region and credentials are the ones botocore resolves, as s3fs
reads them (`AWS_ENDPOINT_URL[_S3]`, `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`/`AWS_SESSION_TOKEN`,
`AWS_PROFILE` with `~/.aws/config` and `~/.aws/credentials`, `AWS_REGION`/`AWS_DEFAULT_REGION`); refreshable
credentials (a role, SSO) are asked of botocore again when they expire. Where obstore cannot do what s3fs
would (no credentials found: s3fs's anonymous or instance-metadata paths; no region for an AWS endpoint: s3fs
asks the bucket), reads stay on s3fs. obstore's own retries are off: `retries.retrying` retries and counts.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
CLIENT_ENV = "DFLASH_S3_CLIENT"
CLIENTS = ("auto", "s3fs", "obstore")


def s3_client() -> str:
    """The client DFLASH_S3_CLIENT asks for: 's3fs' or 'obstore' (auto: obstore when importable)."""
    wanted = os.environ.get(CLIENT_ENV, "auto").strip().lower() or "auto"
    if wanted not in CLIENTS:
        raise ValueError(f"{CLIENT_ENV}={wanted!r}: expected one of {', '.join(CLIENTS)}")
    if wanted == "s3fs":
        return "s3fs"
    try:
        import obstore  # noqa: F401  (installed or not is the question)
    except ImportError:
        if wanted == "obstore":
            raise ValueError(
                f"{CLIENT_ENV}=obstore but obstore is not installed (pip install 'dflash[s3]')"
            ) from None
        return "s3fs"
    return "obstore"


def _resolved(bucket: str) -> tuple[dict[str, Any], Any] | str:
    """(S3Store config, credential provider or None) from what botocore resolves, or why not (a sentence)."""
    import botocore.credentials
    import botocore.session

    session = botocore.session.Session()
    credentials = session.get_credentials()
    if credentials is None:
        return "no credentials found (s3fs may go anonymous or ask instance metadata)"
    client = session.create_client("s3")  # resolves the endpoint as s3fs's client does; makes no request
    endpoint, region = client.meta.endpoint_url.rstrip("/"), client.meta.region_name
    scheme, host = endpoint.split("://", 1)
    if scheme == "https" and session.get_config_variable("ca_bundle"):
        return "a CA bundle is configured for HTTPS (obstore does not read AWS_CA_BUNDLE)"
    if host.endswith(".amazonaws.com"):
        if not session.get_config_variable("region"):
            return "no region configured (s3fs asks the bucket for its region)"
        if "." not in bucket:  # botocore's virtual-hosted style; a dotted name goes path style (TLS)
            endpoint = f"{scheme}://{bucket}.{host}"
    # Always an explicit endpoint: obstore would otherwise take one from variables botocore ignores.
    config: dict[str, Any] = {
        "endpoint": endpoint,
        "region": region or "us-east-1",
        "allow_http": scheme == "http",
        "virtual_hosted_style_request": endpoint != client.meta.endpoint_url.rstrip("/"),
    }
    if isinstance(credentials, botocore.credentials.RefreshableCredentials):
        return config, _Refreshing(credentials)
    frozen = credentials.get_frozen_credentials()
    config |= {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key}
    if frozen.token:
        config["token"] = frozen.token
    return config, None


class _Refreshing:
    """obstore's credential provider over botocore's refreshable credentials (a role, SSO, a container):
    asked again every 5 minutes; botocore hands out credentials valid for 10 minutes at least."""

    def __init__(self, credentials: Any):
        self.credentials = credentials

    def __call__(self) -> dict[str, Any]:
        from datetime import datetime, timezone

        frozen = self.credentials.get_frozen_credentials()  # refreshed by botocore when close to expiry
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": datetime.now(timezone.utc) + timedelta(minutes=5),
        }


def _builtin_error(exc: Exception) -> Exception:
    """obstore's error as `retries.retrying` sorts s3fs's: a connection or timeout error (retried), a refused
    credential (PermissionError), the service's answer by its code (`ServiceError`), a range past the end in
    s3fs's words; anything else as it is."""
    from obstore.exceptions import PermissionDeniedError, UnauthenticatedError

    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    detail = str(exc)
    if "416 Range Not Satisfiable" in detail:  # a range starting past the end: s3fs's words for it
        return OSError(errno.EINVAL, "The requested range is not satisfiable")
    if isinstance(exc, (PermissionDeniedError, UnauthenticatedError)) or "403 Forbidden" in detail:
        return PermissionError(text)
    if "kind: Timeout" in detail or "timed out" in text:
        return TimeoutError(text)
    if any(k in detail for k in ("error sending request", "kind: Connect", "kind: Request", "kind: Body")):
        return ConnectionError(text)
    code = re.search(r"<Code>([^<]+)</Code>", detail) or re.search(r"status code: (\d{3})", detail)
    return ServiceError(text, code.group(1)) if code else exc


class ServiceError(OSError):
    """The service's error answer shaped as botocore's (`response`), so that `retries.retrying` sorts it by its
    code as it sorts s3fs's (SlowDown: throttled; InternalError, 5xx: server_error; others: not retried)."""

    def __init__(self, text: str, code: str):
        super().__init__(text)
        self.response = {"Error": {"Code": code}}


class ObstoreReads:
    """Range reads and whole-object downloads of one bucket prefix through obstore."""

    def __init__(self, store: Any):
        self.store = store

    @classmethod
    def open(cls, bucket: str, prefix: str) -> ObstoreReads | None:
        from obstore.store import S3Store

        resolved = _resolved(bucket)
        if isinstance(resolved, str):
            log.debug("s3://%s/%s read through s3fs, not obstore: %s", bucket, prefix, resolved)
            return None
        config, provider = resolved
        store = S3Store(
            bucket,
            prefix=prefix or None,
            config=config,
            client_options={"connect_timeout": timedelta(seconds=10), "timeout": timedelta(seconds=120)},
            retry_config={"max_retries": 0},
            credential_provider=provider,
        )
        log.debug("s3://%s/%s read through obstore", bucket, prefix)
        return cls(store)

    def _call(self, op: Any) -> Any:
        from obstore.exceptions import BaseError

        try:
            return op()
        except FileNotFoundError:
            raise
        except BaseError as exc:
            raise _builtin_error(exc) from exc

    def read_range(self, key: str, offset: int, size: int) -> bytes:
        import obstore

        return bytes(self._call(lambda: obstore.get_range(self.store, key, start=offset, end=offset + size)))

    def get_file(self, key: str, local: Path) -> None:
        import obstore

        def download() -> None:
            with open(local, "wb") as f:
                for chunk in obstore.get(self.store, key):
                    f.write(chunk)

        self._call(download)
