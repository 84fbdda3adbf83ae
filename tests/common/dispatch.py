"""Counting the tensor operations a call dispatches (for tests and benches): on a GPU each is about one
kernel launch, and each launch releases the GIL and may wait to retake it beside other threads, so their
count, not their bytes, is what a small batch costs there."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

VIEWS = frozenset(("view", "_unsafe_view", "slice", "select", "as_strided", "unsqueeze", "expand", "alias",
                   "detach", "t", "reshape", "split", "unbind"))  # fmt: skip


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops += func.overloadpacket.__name__ not in VIEWS  # views launch nothing
        return func(*args, **(kwargs or {}))


def dispatched_ops(fn: Callable[[], object]) -> int:
    """Tensor operations `fn()` dispatches, views left out."""
    with _OpCounter() as counter:
        fn()
    return counter.ops
