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
