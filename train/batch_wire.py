"""A packed batch as a JSON header plus raw tensor bytes: how loader processes hand batches to the trainer.

    header, tensors = flatten(batch)          # JSON-able tree + the tensors it names by index
    layout, size = place(tensors)             # each tensor's dtype, shape and byte offset in one buffer
    write_tensors(buffer, tensors, layout)    # the bytes, into shared memory
    batch = unflatten(header, read_tensors(buffer, layout))   # views on that memory, no copy

Only the dataclasses in `_TYPES` are rebuilt (never an arbitrary class named by the header), and only the
dtypes in `_DTYPES`: a header is data, not code. No pickle: the processes share JSON lines and memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from .block_mask import KeyIntervals, TileLayout
from .blocks import PackedBatch

_TYPES = {cls.__name__: cls for cls in (PackedBatch, TileLayout, KeyIntervals)}
_INTS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool)
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (*_INTS, torch.float16, torch.bfloat16, torch.float32, torch.float64)
}
ALIGN = 64  # every tensor starts on a cache line


def flatten(value: Any) -> tuple[Any, list[torch.Tensor]]:
    """`value` (a batch, its parts, scalars, tuples) as a JSON-able tree naming tensors by their index."""
    tensors: list[torch.Tensor] = []

    def walk(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return {"tensor": len(tensors) - 1}
        if dataclasses.is_dataclass(v) and type(v).__name__ in _TYPES:
            return {
                "type": type(v).__name__,
                "fields": {f.name: walk(getattr(v, f.name)) for f in dataclasses.fields(v)},
            }
        if isinstance(v, tuple):
            return {"tuple": [walk(x) for x in v]}
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise TypeError(f"batch_wire cannot carry a {type(v).__name__}")

    return walk(value), tensors


def unflatten(tree: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The value `flatten` described, with `tensors` in place of the indexes it holds."""
    if isinstance(tree, dict):
        if "tensor" in tree:
            return tensors[tree["tensor"]]
        if "tuple" in tree:
            return tuple(unflatten(x, tensors) for x in tree["tuple"])
        cls = _TYPES.get(tree.get("type", ""))
        if cls is None:
            raise ValueError(f"batch header names an unknown type {tree.get('type')!r}")
        return cls(**{k: unflatten(v, tensors) for k, v in tree["fields"].items()})
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    raise ValueError(f"batch header holds a {type(tree).__name__}")


def place(tensors: Sequence[torch.Tensor]) -> tuple[list[dict[str, Any]], int]:
    """Each tensor's dtype, shape and aligned offset in one buffer, and the buffer's size."""
    layout, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        layout.append(
            {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": offset}
        )
        offset += -(-nbytes // ALIGN) * ALIGN
    return layout, offset


def _bytes_of(buffer: Any, entry: dict[str, Any]) -> tuple[torch.Tensor | None, torch.dtype, list[int]]:
    dtype = _DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ValueError(f"batch header names an unknown dtype {entry['dtype']!r}")
    shape = [int(s) for s in entry["shape"]]
    nbytes = dtype.itemsize
    for s in shape:
        nbytes *= s
    if nbytes == 0:
        return None, dtype, shape
    raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=int(entry["offset"]))
    return raw, dtype, shape


def write_tensors(buffer: Any, tensors: Sequence[torch.Tensor], layout: Sequence[dict[str, Any]]) -> None:
    """Copy `tensors` into `buffer` (a writable buffer of at least `place`'s size) where `layout` says."""
    for t, entry in zip(tensors, layout, strict=True):
        raw, dtype, shape = _bytes_of(buffer, entry)
        if raw is not None:
            # Into a typed view of the destination: copy_ takes any source strides. (Viewing the source as
            # bytes needs a unit last stride, which a "contiguous" tensor with a size-1 axis need not have.)
            raw.view(dtype).view(shape).copy_(t.detach())


def read_tensors(buffer: Any, layout: Sequence[dict[str, Any]]) -> list[torch.Tensor]:
    """The tensors `write_tensors` put in `buffer`, as views on its memory (clone to keep them past it)."""
    out = []
    for entry in layout:
        raw, dtype, shape = _bytes_of(buffer, entry)
        out.append(torch.empty(shape, dtype=dtype) if raw is None else raw.view(dtype).reshape(shape))
    return out
