"""Fixtures shared by test modules (opt in with `pytestmark = pytest.mark.usefixtures(...)`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    # Tiny models: thread hand-offs cost more than the math, and CI runs test files in parallel.
    import torch  # here, not at the top: test modules that never touch torch must not pay its import

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A real S3 server (moto's, in a subprocess on a free port) for this test session (`common/s3.py`)."""
    from common.s3 import S3Server

    server = S3Server.start(tmp_path_factory.mktemp("s3"))
    yield server
    server.close()


@pytest.fixture
def s3(s3_server: object, monkeypatch: pytest.MonkeyPatch) -> object:
    """`s3_server` with this test's environment pointed at it (AWS_ENDPOINT_URL and test credentials)."""
    for key, value in s3_server.env.items():  # type: ignore[attr-defined]
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return s3_server
