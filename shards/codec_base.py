"""What every hidden-state codec shares: the `Codec` interface, dtype names, zstd frames that must decode
to an exact size (or only a prefix of it), and NaN/inf counting from exponent bits.

The codecs: `codecs.py` (`lossless`, and the name registry every caller goes through), `fp8.py` (`fp8`),
`qcodec.py` (`q6`, `q4`). Compressor objects are not thread-safe, hence one per thread.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
import zstandard

from .errors import CorruptFrame
from .sizes import ITEMSIZE

if TYPE_CHECKING:
    from .fp8 import Fp8Block

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
_SCAN_CHUNK = 1 << 18  # elements per step of the CPU NaN/inf scans (verify, training's checks)

# Activation byte planes are mostly literals (entropy-coded sign/exponent bytes) with few long matches:
# a small hash table and 7-byte minimum matches skip futile match search. Measured on LLM-like bf16
# high-byte planes: 2.5x faster to encode, 1.3x faster to decode, and 2% smaller than plain level 1.
# Only the writer is affected; every zstd decoder reads the result.
_LEVEL1_TUNING = {"hash_log": 10, "min_match": 7}

_local = threading.local()


def dtype_name(dtype: torch.dtype | np.dtype | str) -> str:
    """Canonical dtype name ('bfloat16', 'float16', 'float32') of a torch/numpy dtype or name."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
    elif isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    else:
        name = np.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"unsupported hidden-state dtype {dtype!r}: use one of {sorted(DTYPES)}")
    return name


def compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    if level not in cache:
        params = zstandard.ZstdCompressionParameters.from_level(
            level, write_content_size=True, write_checksum=False, **(_LEVEL1_TUNING if level == 1 else {})
        )
        cache[level] = zstandard.ZstdCompressor(compression_params=params)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    dec = getattr(_local, "decompressor", None)
    if dec is None:
        dec = _local.decompressor = zstandard.ZstdDecompressor()
    return dec


def zstd_compress(data: Any, level: int = 1) -> bytes:
    return compressor(level).compress(data)


def zstd_frame_of(parts: Sequence[torch.Tensor], level: int = 1) -> bytes:
    """One zstd frame over the parts' bytes in order (multi-byte values little-endian), from any device.

    Copied into one buffer and compressed in one call, because the extractor encodes on threads beside the
    one that launches the target's forward: python-zstandard's streaming `compress` takes the GIL back for
    every ~128 KB of output (~40 times for one fp8 layer of 1,500 tokens x 4096), and each time can hold
    up that launching thread; the one-shot call takes it back once, and torch's copies run without it.
    Multi-byte parts must come first (each view must be aligned to its element size)."""
    sizes = [p.numel() * p.element_size() for p in parts]
    frame = torch.empty(sum(sizes), dtype=torch.uint8)
    pos = 0
    with torch.no_grad():
        for part, size in zip(parts, sizes, strict=True):
            dst = frame[pos : pos + size].view(part.dtype).view(part.shape)
            dst.copy_(part)
            if sys.byteorder == "big" and part.element_size() > 1:
                dst.numpy().byteswap(inplace=True)
            pos += size
    return zstd_compress(frame.numpy(), level)


def zstd_decompress_exact(
    buf: bytes | memoryview, size: int, what: str, keep: int | None = None
) -> bytes | bytearray:
    """Decompress one zstd frame that must decode to exactly `size` bytes (never allocates more).

    `keep` < size decodes only the first `keep` bytes (zstd stops after the blocks that hold them), so a
    reader that needs a prefix never allocates, or spends time on, the rest."""
    declared = declared_size(buf, what)
    if declared != size:
        raise CorruptFrame(f"{what}: zstd frame declares {declared} bytes, expected {size}")
    if keep is not None and keep < size:
        return _zstd_prefix(buf, keep, what)
    try:
        out = _decompressor().decompress(buf, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise CorruptFrame(f"{what}: zstd error: {exc}") from None
    if len(out) != size:
        raise CorruptFrame(f"{what}: decoded {len(out)} bytes, expected {size}")
    return out


def declared_size(buf: bytes | memoryview, what: str) -> int:
    try:
        return zstandard.frame_content_size(buf)
    except zstandard.ZstdError as exc:
        raise CorruptFrame(f"{what}: not a zstd frame ({exc})") from None


def _zstd_prefix(buf: bytes | memoryview, keep: int, what: str) -> bytearray:
    out = bytearray(keep)
    view, pos = memoryview(out), 0
    try:
        with _decompressor().stream_reader(buf, read_across_frames=False) as reader:
            while pos < keep:
                n = reader.readinto(view[pos:])
                if not n:
                    break
                pos += n
    except zstandard.ZstdError as exc:
        raise CorruptFrame(f"{what}: zstd error: {exc}") from None
    if pos != keep:
        raise CorruptFrame(f"{what}: frame ended after {pos} bytes, expected at least {keep}")
    return out


_EXPONENT_BITS = {  # float dtype -> (same-width int dtypes in torch and numpy, exponent all ones: NaN/inf)
    torch.bfloat16: (torch.int16, np.uint16, 0x7F80),
    torch.float16: (torch.int16, np.uint16, 0x7C00),
    torch.float32: (torch.int32, np.uint32, 0x7F800000),
    torch.float64: (torch.int64, np.uint64, 0x7FF0000000000000),
}
_DEVICE_SCAN_CHUNK = 1 << 26  # elements per isfinite call on a GPU (a 64 MiB bool temporary)


def divide_exactly(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """x / divisor, correctly rounded on every device: CUDA divides by a Python number as a multiply by its
    float32 reciprocal (one ulp off the quotient for some values), so a GPU's scales, and the codes rounded
    against them, would not be the CPU's. A tensor divisor is divided as on the CPU."""
    return x / torch.full_like(x, divisor)


def count_nonfinite(x: torch.Tensor) -> int:
    """Number of NaN/inf elements of a float tensor, counted where it lives (no copy): on a device, `isfinite`
    in chunks summed there and one host sync (milliseconds for Qwen3-8B's [151936, 4096] embedding); on the
    CPU, the exponent bits in cache-sized steps, no float temporaries (~0.25 s for that table on one core)."""
    if x.dtype not in _EXPONENT_BITS:
        raise ValueError(f"unsupported dtype {x.dtype} (expected bfloat16, float16, float32 or float64)")
    flat = x.detach().contiguous().view(-1)
    if flat.device.type != "cpu":
        bad = torch.zeros((), dtype=torch.int64, device=flat.device)
        for c0 in range(0, flat.numel(), _DEVICE_SCAN_CHUNK):
            part = flat[c0 : c0 + _DEVICE_SCAN_CHUNK]
            bad += part.numel() - torch.isfinite(part).sum()
        return int(bad)
    as_int, as_uint, mask = _EXPONENT_BITS[flat.dtype]
    return count_masked(flat.view(as_int).numpy().view(as_uint), mask)


def count_masked(data: np.ndarray, mask: int, next_plane: np.ndarray | None = None) -> int:
    """How many elements i of an unsigned integer array have data[i] & mask == mask (and next_plane[i] >= 0x80
    when given), in cache-sized steps through two small scratch buffers: full-size temporaries cost more
    than the arithmetic."""
    step = max(1, min(data.size, _SCAN_CHUNK))
    masked, hit = np.empty(step, dtype=data.dtype), np.empty(step, dtype=np.bool_)
    mask = data.dtype.type(mask)
    total = 0
    for c0 in range(0, data.size, step):
        part = data[c0 : c0 + step]
        m, b = masked[: part.size], hit[: part.size]
        np.bitwise_and(part, mask, out=m)
        np.equal(m, mask, out=b)
        if next_plane is None:
            total += int(np.count_nonzero(b))
        elif b.any():
            total += int(np.count_nonzero(next_plane[c0 : c0 + part.size][b] >= 0x80))
    return total


class Codec:
    """Encodes one [S, H] layer of one sample into one frame's bytes and back."""

    name: ClassVar[str]
    # True: training may read frames undecoded (`decode_block`) and decode them on its GPU
    device_decode: ClassVar[bool] = False

    def __init__(self, level: int = 1):
        if not isinstance(level, int) or not 1 <= level <= 22:
            raise ValueError(
                f"codec level must be an int in 1..22, got {level!r}; 1 is fastest and best here"
            )
        self.level = level

    @property
    def params(self) -> dict[str, Any]:
        return {"level": self.level}

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **self.params}

    def stored_dtype(self, input_dtype: str) -> str:
        """The dtype `decode` returns for input of `input_dtype` (recorded in the manifest and index)."""
        return input_dtype

    def decoded_bytes(self, tokens: int, hidden: int, dtype: str) -> int:
        """Bytes a frame of [tokens, hidden] decompresses to (bounds allocation for hostile input)."""
        return tokens * hidden * ITEMSIZE[dtype_name(dtype)]

    def quantize_batch(self, packed: torch.Tensor, lengths: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """What the extractor copies to the host for [K, N, H] layers of rows of `lengths` back to back
        (run on the GPU: quantizing codecs shrink it there); the input itself by default."""
        return (packed,)

    def batch_sample(
        self, parts: tuple[torch.Tensor, ...], lengths: Sequence[int], i: int, offset: int
    ) -> list[Any]:
        """Row i's per-layer `encode` inputs (views, no copy) from `quantize_batch` output copied to the host;
        `offset` = the sum of the lengths before row i."""
        (packed,) = parts
        n = int(lengths[i])
        return [packed[k, offset : offset + n] for k in range(packed.shape[0])]

    def encode(self, x: torch.Tensor | np.ndarray | Fp8Block) -> bytes:
        raise NotImplementedError

    def decode(
        self, buf: bytes | memoryview, shape: tuple[int, int], dtype: str | torch.dtype
    ) -> torch.Tensor:
        raise NotImplementedError

    def decode_rows(
        self, buf: bytes | memoryview, shape: tuple[int, int], dtype: str | torch.dtype, rows: int
    ) -> torch.Tensor:
        """The first `rows` tokens of the frame (a reader cut to --max-length); codecs that can stop early
        override this so the rest is never decoded."""
        out = self.decode(buf, shape, dtype)
        return out if rows >= shape[0] else out[:rows].clone()

    def nonfinite(self, buf: bytes | memoryview, shape: tuple[int, int], dtype: str | torch.dtype) -> int:
        """NaN/inf values the frame decodes to (what `verify` checks); overrides count without decoding."""
        return count_nonfinite(self.decode(buf, shape, dtype))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.to_dict().items())))
