"""torch's intra-op thread count for the length of a block, restored after it (whatever the block raises)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    import torch  # here, not at import: light paths (the CLI's errors, the dry run) never load torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
