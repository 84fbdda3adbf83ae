"""Hidden-state codecs behind a name registry (byte-exact definitions: FORMAT.md, "Codecs").

`lossless`: split the little-endian elements into byte planes (plane k holds byte k of every element),
then zstd each plane at level 1; a plane zstd cannot shrink (the low bf16 byte is nearly noise) is stored
raw, which also saves its compression time. `fp8`: e4m3fn values with one fp32 scale per token (absmax /
448), zstd level 1; `quantize_fp8` runs on any torch device so the extractor quantizes on the GPU.

Every heavy step (zstd, numpy and torch element loops) releases the GIL, so N threads give ~N cores.
Compressor objects are not thread-safe, hence one per thread.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import zstandard

from .errors import CorruptFrame

FP8_MAX = 448.0  # largest finite float8_e4m3fn value
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
# Where a value's exponent sits in its top byte (mask) and whether its lowest bit is the next byte's top bit.
_EXPONENT_BITS = {"bfloat16": (0x7F, True), "float16": (0x7C, False), "float32": (0x7F, True)}
_PROBE_BYTES = 1 << 16  # a plane whose first 64 KiB zstd cannot shrink by 2% is stored raw
_RAW_PROBE_RATIO = 0.98
_QUANT_CHUNK = 1 << 24  # elements per step of quantize_fp8 (a 64 MiB float32 temporary)
_DEQUANT_CHUNK = 1 << 18
_SCAN_CHUNK = 1 << 18  # bytes per step of the NaN/inf scan (verify)
_ENCODE_CHUNK = (
    1 << 18
)  # bytes of one plane per zstd step: small reused buffers stay in cache  # elements per step of the CPU fp8 dequantizer (measured best of 2^14..2^21)

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


def _compressor(level: int) -> zstandard.ZstdCompressor:
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
    return _compressor(level).compress(data)


def zstd_decompress_exact(
    buf: bytes | memoryview, size: int, what: str, keep: int | None = None
) -> bytes | bytearray:
    """Decompress one zstd frame that must decode to exactly `size` bytes (never allocates more).

    `keep` < size decodes only the first `keep` bytes (zstd stops after the blocks that hold them), so a
    reader that needs a prefix never allocates, or spends time on, the rest."""
    declared = _declared_size(buf, what)
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


def _declared_size(buf: bytes | memoryview, what: str) -> int:
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


def count_nonfinite(x: torch.Tensor) -> int:
    """Number of NaN/inf elements of a float tensor (exponent bits all ones; no float temporaries)."""
    name = dtype_name(x.dtype)
    t = x.detach().cpu().contiguous()
    if name == "float32":
        bits, mask = t.view(torch.int32).numpy().view(np.uint32), np.uint32(0x7F800000)
    else:
        bits = t.view(torch.int16).numpy().view(np.uint16)
        mask = np.uint16(0x7F80 if name == "bfloat16" else 0x7C00)
    return int(np.count_nonzero(np.bitwise_and(bits, mask) == mask))


@dataclass(slots=True)
class Fp8Block:
    """One layer of one sample quantized to fp8: `q` uint8 [S, H] (e4m3fn bits), `scale` float32 [S]."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))


def quantize_fp8(x: torch.Tensor) -> Fp8Block:
    """Quantize [S, H] to e4m3fn with one fp32 scale per token (absmax / 448); runs on x's device.

    Works in row chunks so the float32 temporary stays <= 64 MiB whatever the batch size (the extractor
    calls this on GPU batches of many thousand tokens x K layers)."""
    if x.ndim != 2:
        raise ValueError(f"quantize_fp8 expects [S, H], got shape {tuple(x.shape)}")
    s, h = x.shape
    q = torch.empty((s, h), dtype=torch.uint8, device=x.device)
    if h == 0 or s == 0:
        return Fp8Block(q=q, scale=torch.ones(s, dtype=torch.float32, device=x.device))
    # max(amax, -amin): no |x| temporary (and 6x faster than aminmax on CPU); NaN propagates.
    amax = torch.maximum(x.amax(dim=1).float(), -x.amin(dim=1).float())
    # An all-zero token keeps scale 1 so dequantization never multiplies garbage by 0/0.
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    rows = max(1, _QUANT_CHUNK // h)
    for r0 in range(0, s, rows):
        # out of place: .float() of a float32 input is the input itself, which must stay untouched
        part = torch.div(x[r0 : r0 + rows].float(), scale[r0 : r0 + rows, None]).clamp_(-FP8_MAX, FP8_MAX)
        q[r0 : r0 + rows] = part.to(torch.float8_e4m3fn).view(torch.uint8)
    return Fp8Block(q=q, scale=scale)


def dequantize_fp8(block: Fp8Block, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """q * scale rounded once to `dtype`; on the GPU for training, or anywhere for checks."""
    return (block.q.view(torch.float8_e4m3fn).float() * block.scale[:, None].float()).to(dtype)


def _dequantize_fp8_cpu(q: np.ndarray, scale: np.ndarray) -> torch.Tensor:
    """Same bits as dequantize_fp8(..., bfloat16), ~6x faster on CPU than torch's scalar fp8 cast.

    e4m3fn bits s.eeee.mmm placed at float32 bits 31 | 26..23 | 22..20 read as 2^(e-127) * (1 + m/8)
    for e > 0 and as the float32 subnormal m * 2^-129 for e = 0; one multiply by 2^120 rebiases both
    exactly, then one multiply applies the token scale (in two steps: 2^120 * scale could overflow).
    Works in row chunks through two reused buffers: fresh full-size temporaries cost more in page
    faults than the arithmetic itself."""
    s, h = q.shape
    out = torch.empty((s, h), dtype=torch.bfloat16)
    if out.numel() == 0:
        return out
    rows = max(1, _DEQUANT_CHUNK // h)
    bits_buf = np.empty(min(rows, s) * h, dtype=np.uint32)
    sign_buf = np.empty_like(bits_buf)
    scale_t = torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32))
    for r0 in range(0, s, rows):
        r1 = min(s, r0 + rows)
        bits, sign = bits_buf[: (r1 - r0) * h], sign_buf[: (r1 - r0) * h]
        np.copyto(bits, q[r0:r1].reshape(-1), casting="unsafe")
        np.bitwise_and(bits, 0x80, out=sign)
        np.left_shift(sign, 24, out=sign)
        np.bitwise_and(bits, 0x7F, out=bits)
        nan = bits == 0x7F  # e4m3fn has no inf; S.1111.111 is NaN (only from non-finite input)
        np.left_shift(bits, 20, out=bits)
        np.bitwise_or(bits, sign, out=bits)
        x = torch.from_numpy(bits.view(np.float32)).view(r1 - r0, h)
        x.mul_(2.0**120)
        x.mul_(scale_t[r0:r1, None])
        if nan.any():
            x.view(-1)[torch.from_numpy(nan)] = float("nan")
        out[r0:r1].copy_(x)
    return out


def _count_masked(data: np.ndarray, mask: int, next_plane: np.ndarray | None = None) -> int:
    """How many bytes i have data[i] & mask == mask (and next_plane[i] >= 0x80 when given), in cache-sized
    steps through two small scratch buffers: full-size temporaries cost more than the arithmetic."""
    step = max(1, min(data.size, _SCAN_CHUNK))
    masked, hit = np.empty(step, dtype=np.uint8), np.empty(step, dtype=np.bool_)
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
        return tokens * hidden * _ITEMSIZE[dtype_name(dtype)]

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
        cobj = _compressor(self.level).compressobj(size=n)
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
                if length < n and _declared_size(chunk, f"lossless plane {k}") != n:  # header only
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
        e = _ITEMSIZE[name]
        n = shape[0] * shape[1]
        top_mask, next_bit = _EXPONENT_BITS[name]
        planes = self._planes(buf, n, e, only=range(e - 2 if next_bit else e - 1, e))
        return _count_masked(planes[e - 1], top_mask, planes[e - 2] if next_bit else None)

    def decode(
        self, buf: bytes | memoryview, shape: tuple[int, int], dtype: str | torch.dtype
    ) -> torch.Tensor:
        return self.decode_rows(buf, shape, dtype, shape[0])

    def decode_rows(
        self, buf: bytes | memoryview, shape: tuple[int, int], dtype: str | torch.dtype, rows: int
    ) -> torch.Tensor:
        name = dtype_name(dtype)
        itemsize = _ITEMSIZE[name]
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


class Fp8Codec(Codec):
    """fp8 e4m3fn + per-token fp32 scale: frame = zstd(scale f32 LE [S] || q u8 [S*H])."""

    name = "fp8"
    device_decode = True

    def quantize_batch(self, packed: torch.Tensor, lengths: Sequence[int]) -> tuple[torch.Tensor, ...]:
        block = quantize_fp8(packed.reshape(-1, packed.shape[-1]))
        return (block.q.view(packed.shape), block.scale.view(packed.shape[:2]))

    def batch_sample(
        self, parts: tuple[torch.Tensor, ...], lengths: Sequence[int], i: int, offset: int
    ) -> list[Fp8Block]:
        q, scale = parts
        rows = slice(offset, offset + int(lengths[i]))
        return [Fp8Block(q=q[k, rows], scale=scale[k, rows]) for k in range(q.shape[0])]

    def stored_dtype(self, input_dtype: str) -> str:
        return "bfloat16"

    def decoded_bytes(self, tokens: int, hidden: int, dtype: str) -> int:
        return tokens * (hidden + 4)

    def encode(self, x: torch.Tensor | np.ndarray | Fp8Block) -> bytes:
        if not isinstance(x, Fp8Block):
            t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))
            x = quantize_fp8(t)
        if x.q.ndim != 2 or x.q.dtype != torch.uint8 or x.scale.shape != (x.q.shape[0],):
            raise ValueError(
                f"malformed Fp8Block: q {x.q.dtype} {tuple(x.q.shape)}, scale {tuple(x.scale.shape)}"
            )
        scale = x.scale.detach().cpu().float().contiguous().numpy().astype("<f4", copy=False)
        q = x.q.detach().cpu().contiguous().numpy()
        # One zstd frame over scale || q without concatenating them first (saves an S*H copy).
        cobj = _compressor(self.level).compressobj(size=scale.nbytes + q.nbytes)
        return cobj.compress(scale.tobytes()) + cobj.compress(memoryview(q).cast("B")) + cobj.flush()

    def decode_block(
        self, buf: bytes | memoryview, shape: tuple[int, int], rows: int | None = None
    ) -> Fp8Block:
        """The stored q and scales (first `rows` tokens) without dequantizing (a trainer can dequantize
        on its GPU)."""
        q, scale = self._unpack(buf, shape, rows)
        return Fp8Block(q=torch.from_numpy(q.copy()), scale=torch.from_numpy(scale))

    def decode(
        self, buf: bytes | memoryview, shape: tuple[int, int], dtype: str | torch.dtype
    ) -> torch.Tensor:
        return _dequantize_fp8_cpu(*self._unpack(buf, shape))

    def decode_rows(
        self, buf: bytes | memoryview, shape: tuple[int, int], dtype: str | torch.dtype, rows: int
    ) -> torch.Tensor:
        return _dequantize_fp8_cpu(*self._unpack(buf, shape, rows))

    def nonfinite(self, buf: bytes | memoryview, shape: tuple[int, int], dtype: str | torch.dtype) -> int:
        q, scale = self._unpack(buf, shape)
        nan = _count_masked(q.reshape(-1), 0x7F)  # S.1111.111: e4m3fn's only NaN
        bad_scale = ~np.isfinite(scale)
        if bad_scale.any():  # every value of such a token decodes to inf or NaN (q = 0 gives 0 * inf)
            nan += int(bad_scale.sum()) * shape[1] - np.count_nonzero(
                np.bitwise_and(q[bad_scale], 0x7F) == 0x7F
            )
        return int(nan)

    @staticmethod
    def _unpack(
        buf: bytes | memoryview, shape: tuple[int, int], rows: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        s, h = shape
        rows = s if rows is None else min(rows, s)
        raw = zstd_decompress_exact(buf, 4 * s + s * h, "fp8 frame", keep=4 * s + rows * h)
        scale = np.frombuffer(raw, dtype="<f4", count=rows).astype(np.float32)
        return np.frombuffer(raw, dtype=np.uint8, offset=4 * s, count=rows * h).reshape(rows, h), scale


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
