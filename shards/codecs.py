"""Hidden-state codecs behind a name registry (byte-exact definitions: FORMAT.md, "Codecs").

`lossless` (here): split the little-endian elements into byte planes (plane k holds byte k of every
element), then zstd each plane at level 1; a plane zstd cannot shrink (the low bf16 byte is nearly noise)
is stored raw, which also saves its compression time. `fp8` (`fp8.py`): e4m3fn values with one fp32 scale
per token. `q6`, `q4` (`qcodec.py`): integer codes with per-group scales. What every codec shares (the
`Codec` interface, zstd frames, NaN/inf counting) is in `codec_base.py`; this module re-exports it, so
`dflash.shards.codecs` stays the one import for callers.

Every heavy step (zstd, numpy and torch element loops) releases the GIL, so N threads give ~N cores.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .codec_base import (
    DTYPES,
    ITEMSIZE,
    Codec,
    compressor,
    count_masked,
    count_nonfinite,
    declared_size,
    dtype_name,
    zstd_compress,
    zstd_decompress_exact,
)
from .errors import CorruptFrame
from .fp8 import FP8_MAX, Fp8Block, Fp8Codec, dequantize_fp8, quantize_fp8

__all__ = [
    "DTYPES",
    "FP8_MAX",
    "Codec",
    "Fp8Block",
    "Fp8Codec",
    "LosslessCodec",
    "codec_from_dict",
    "codec_names",
    "count_nonfinite",
    "dequantize_fp8",
    "dtype_name",
    "get_codec",
    "quantize_fp8",
    "register_codec",
    "zstd_compress",
    "zstd_decompress_exact",
]

# Where a value's exponent sits in its top byte (mask) and whether its lowest bit is the next byte's top bit.
_EXPONENT_BITS = {"bfloat16": (0x7F, True), "float16": (0x7C, False), "float32": (0x7F, True)}
_PROBE_BYTES = 1 << 16  # a plane whose first 64 KiB zstd cannot shrink by 2% is stored raw
_RAW_PROBE_RATIO = 0.98
_ENCODE_CHUNK = 1 << 18  # bytes of one plane per zstd step: small reused buffers stay in cache


def _plane_bytes(words: np.ndarray, k: int, tmp: np.ndarray, dst: np.ndarray) -> None:
    """dst[i] = byte k (0 = least significant) of words[i]; shift + truncating copy beats a strided gather 3x."""
    src = words
    if k:
        src = tmp[: words.size]
        np.right_shift(words, 8 * k, out=src)
    np.copyto(dst, src, casting="unsafe")


def _put(out: np.ndarray, pos: int, data: bytes) -> int:
    if data:
        out[pos : pos + len(data)] = np.frombuffer(data, dtype=np.uint8)
    return pos + len(data)


def _as_uint_numpy(x: torch.Tensor | np.ndarray) -> tuple[np.ndarray, str]:
    """The [S, H] elements as a C-contiguous unsigned-int numpy array (little-endian bits) and the dtype name."""
    if isinstance(x, torch.Tensor):
        name = dtype_name(x.dtype)
        t = x.detach().cpu().contiguous()
        if name == "float32":
            return t.view(torch.int32).numpy().view(np.uint32), name
        return t.view(torch.int16).numpy().view(np.uint16), name
    arr = np.asarray(x)
    name = dtype_name(arr.dtype)
    arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    return arr.view(np.uint32 if name == "float32" else np.uint16), name


class LosslessCodec(Codec):
    """Byte planes + zstd: frame = u32 LE chunk length per plane, then the chunks (raw if length == S*H)."""

    name = "lossless"
    probe = True  # skip zstd on planes whose first 64 KiB do not compress (bench ablation turns it off)

    def encode(self, x: torch.Tensor | np.ndarray | Fp8Block) -> bytes:
        if isinstance(x, Fp8Block):
            raise ValueError(
                "the lossless codec cannot store an Fp8Block; use codec 'fp8' or pass the bf16 tensor"
            )
        u, _ = _as_uint_numpy(x)
        if u.ndim != 2:
            raise ValueError(f"expected a [S, H] layer, got shape {u.shape}")
        n, e = u.size, u.itemsize
        flat = u.reshape(-1)
        # Worst case every plane raw, plus slack for one zstd piece past a plane's end. Pages never
        # written are never touched, so the generous bound costs address space, not memory.
        out = np.empty(4 * e + e * n + 2 * _ENCODE_CHUNK + (1 << 17), dtype=np.uint8)
        tmp = np.empty(min(n, _ENCODE_CHUNK), dtype=flat.dtype)
        pos = 4 * e
        lengths = []
        for k in range(e):
            start = pos
            pos = self._compress_plane(flat, k, tmp, out, pos)
            if pos is None:  # zstd would not shrink it: store it raw
                pos = start + n
                for c0 in range(0, n, _ENCODE_CHUNK):
                    c1 = min(n, c0 + _ENCODE_CHUNK)
                    _plane_bytes(flat[c0:c1], k, tmp, out[start + c0 : start + c1])
            lengths.append(pos - start)
        out[: 4 * e] = np.frombuffer(struct.pack(f"<{e}I", *lengths), dtype=np.uint8)
        return out[:pos].data

    def _compress_plane(
        self, flat: np.ndarray, k: int, tmp: np.ndarray, out: np.ndarray, pos: int
    ) -> int | None:
        """zstd byte plane k of `flat` into out[pos:] in cache-sized steps; None if it does not shrink."""
        n = flat.size
        if n == 0:
            return None
        buf = np.empty(min(n, _ENCODE_CHUNK), dtype=np.uint8)
        if self.probe and n > 4 * _PROBE_BYTES:
            probe = buf[:_PROBE_BYTES]
            _plane_bytes(flat[:_PROBE_BYTES], k, tmp, probe)
            if len(zstd_compress(probe, self.level)) > _RAW_PROBE_RATIO * _PROBE_BYTES:
                return None
        end = pos + n  # a compressed plane must stay strictly shorter than the raw one
        cobj = compressor(self.level).compressobj(size=n)
        for c0 in range(0, n, _ENCODE_CHUNK):
            chunk = buf[: min(n - c0, _ENCODE_CHUNK)]
            _plane_bytes(flat[c0 : c0 + chunk.size], k, tmp, chunk)
            pos = _put(out, pos, cobj.compress(chunk))
            if pos >= end:
                return None
        pos = _put(out, pos, cobj.flush())
        return pos if pos < end else None

    @staticmethod
    def _planes(
        buf: bytes | memoryview, n: int, itemsize: int, keep: int | None = None, only: range | None = None
    ) -> dict[int, np.ndarray]:
        """Byte planes `only` (default all) of an n-element frame, each cut to its first `keep` bytes."""
        view = memoryview(buf)
        head = 4 * itemsize
        if len(view) < head:
            raise CorruptFrame(f"lossless frame of {len(view)} bytes is shorter than its {head}-byte header")
        lengths = struct.unpack_from(f"<{itemsize}I", view)
        if sum(lengths) != len(view) - head:
            raise CorruptFrame(
                f"lossless plane lengths {list(lengths)} do not add up to the frame size {len(view)}"
            )
        keep = n if keep is None else min(keep, n)
        planes = {}
        pos = head
        for k, length in enumerate(lengths):
            chunk = view[pos : pos + length]
            pos += length
            if length > n:
                raise CorruptFrame(f"lossless plane {k} is {length} bytes, more than its {n} elements")
            if only is not None and k not in only:
                if length < n and declared_size(chunk, f"lossless plane {k}") != n:  # header only
                    raise CorruptFrame(f"lossless plane {k}: zstd frame does not declare {n} bytes")
                continue
            if length == n:
                raw = chunk[:keep]
            else:
                raw = zstd_decompress_exact(chunk, n, f"lossless plane {k}", keep)
            planes[k] = np.frombuffer(raw, dtype=np.uint8)
        return planes

    def nonfinite(self, buf: bytes | memoryview, shape: tuple[int, int], dtype: str | torch.dtype) -> int:
        # A value is NaN/inf when its exponent bits are all ones: they sit in the top byte plane (and the
        # top bit of the next one for bfloat16/float32), so the low planes are never decompressed.
        name = dtype_name(dtype)
        e = ITEMSIZE[name]
        n = shape[0] * shape[1]
        top_mask, next_bit = _EXPONENT_BITS[name]
        planes = self._planes(buf, n, e, only=range(e - 2 if next_bit else e - 1, e))
        return count_masked(planes[e - 1], top_mask, planes[e - 2] if next_bit else None)

    def decode(
        self, buf: bytes | memoryview, shape: tuple[int, int], dtype: str | torch.dtype
    ) -> torch.Tensor:
        return self.decode_rows(buf, shape, dtype, shape[0])

    def decode_rows(
        self, buf: bytes | memoryview, shape: tuple[int, int], dtype: str | torch.dtype, rows: int
    ) -> torch.Tensor:
        name = dtype_name(dtype)
        itemsize = ITEMSIZE[name]
        rows = min(rows, shape[0])
        n = rows * shape[1]
        planes = self._planes(buf, shape[0] * shape[1], itemsize, keep=n)
        shape = (rows, shape[1])
        if itemsize == 2:
            out = np.empty(n, dtype=np.uint16)
            if n:
                np.left_shift(planes[1], 8, out=out, dtype=np.uint16)
                np.bitwise_or(out, planes[0], out=out)
            t = torch.from_numpy(out.view(np.int16)).view(DTYPES[name])
        else:
            out = np.empty((n, 4), dtype=np.uint8)
            for k in range(4):
                out[:, k] = planes[k]
            t = torch.from_numpy(out.reshape(-1).view(np.int32)).view(torch.float32)
        return t.reshape(shape)


_REGISTRY: dict[str, type[Codec]] = {LosslessCodec.name: LosslessCodec, Fp8Codec.name: Fp8Codec}


def register_codec(cls: type[Codec]) -> type[Codec]:
    _REGISTRY[cls.name] = cls
    return cls


def _registry() -> dict[str, type[Codec]]:
    from . import qcodec  # noqa: F401  (registers q4/q6; it builds on this module, so it loads second)

    return _REGISTRY


def codec_names() -> list[str]:
    """Every codec name, in the order users choose from: lossless, fp8, then the denser ones."""
    return list(_registry())


def get_codec(name: str, **params: Any) -> Codec:
    """The codec registered as `name` ('lossless', 'fp8', 'q6', 'q4') with its parameters (e.g. level=1)."""
    registry = _registry()
    if name not in registry:
        raise ValueError(f"unknown codec {name!r}: choose one of {codec_names()}")
    try:
        return registry[name](**params)
    except TypeError as exc:
        raise ValueError(f"bad parameters {params} for codec {name!r}: {exc}") from None


def codec_from_dict(d: Mapping[str, Any]) -> Codec:
    """Rebuild a codec from `Codec.to_dict()` output (as stored in manifests and shard indexes)."""
    if not isinstance(d, Mapping) or not isinstance(d.get("name"), str):
        raise ValueError(f"codec description must be a dict with a 'name', got {d!r}")
    params = {k: v for k, v in d.items() if k != "name"}
    return get_codec(d["name"], **params)
