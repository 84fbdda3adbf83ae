"""Byte layout of one shard file, shared by the writer and the reader (spec: FORMAT.md, "Shard file").

    [magic 8 B] [frame][frame]... (back to back) [index: UTF-8 JSON] [footer 32 B]
    footer = index_offset u64 LE | index_length u64 LE | xxh3_64(index) u64 LE | footer magic 8 B

Frames of one sample, in order: input_ids, loss_mask, then one per layer in the index's `layers` order.
Index parsing distrusts its input: bounded sizes, integer-only offsets, frames that tile the data region
exactly (no hole, no overlap, nothing outside it).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import xxhash

from .codecs import DTYPES, Codec, codec_from_dict
from .errors import ShardError
from .safe_io import load_json

MAGIC = b"DFSHARD1"
FOOTER_MAGIC = b"DFSFOOT1"
FOOTER = struct.Struct("<QQQ8s")
SHARD_FORMAT = "dflash-shard"
SHARD_VERSION = 1
FIXED_FRAMES = ("input_ids", "loss_mask")
# zstd's own worst case is ~32k:1 (RLE blocks); a frame may not claim to decode to more than this.
MAX_EXPANSION = 1 << 16
EXPANSION_SLACK = 1 << 20
# Hard ceiling on what one frame may decode to, whatever the index and manifest claim: 8 GiB holds
# ~800k tokens of a 5120-wide bf16 layer. Readers also bound lengths by the cache's declared maximum.
MAX_FRAME_BYTES = 1 << 33
_U63 = (1 << 63) - 1


def checksum(data: bytes | memoryview) -> str:
    """A frame's checksum as stored in the index: xxh3_64, 16 lowercase hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


def index_checksum(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


def frame_names(layers: list[int]) -> list[str]:
    return [*FIXED_FRAMES, *(f"layer {i}" for i in layers)]


@dataclass(frozen=True, slots=True)
class Entry:
    """One sample of a shard as the index describes it; `frames` is ((offset, length, checksum), ...)."""

    row: int
    length: int
    supervised: int
    frames: tuple[tuple[int, int, str], ...]

    @property
    def start(self) -> int:
        return self.frames[0][0]

    @property
    def end(self) -> int:
        return self.frames[-1][0] + self.frames[-1][1]


@dataclass(frozen=True, slots=True)
class ShardIndex:
    codec: Codec
    layers: list[int]
    dtype: str
    hidden_size: int
    meta: dict[str, Any]
    entries: list[Entry]


def max_decoded(frame_length: int) -> int:
    return frame_length * MAX_EXPANSION + EXPANSION_SLACK


def _int(value: Any, what: str, lo: int = 0, hi: int = _U63) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise ShardError(f"{what} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def parse_footer(footer: bytes, file_size: int, where: str) -> tuple[int, int, int]:
    """(index_offset, index_length, index_xxh3) after checking the footer against the file size."""
    offset, length, digest, magic = FOOTER.unpack(footer)
    if magic != FOOTER_MAGIC:
        raise ShardError(f"{where}: bad footer magic {magic!r}: truncated or not a committed dflash shard")
    data_end = file_size - FOOTER.size
    # Both bounds are checked separately so a huge offset/length cannot overflow into range.
    if offset < len(MAGIC) or offset > data_end or length > data_end - offset or offset + length != data_end:
        raise ShardError(
            f"{where}: footer places the index at {offset}+{length}, but the file is {file_size} bytes "
            f"(index must end at {data_end}): truncated or corrupt"
        )
    return offset, length, digest


def parse_index(raw: bytes, index_offset: int, where: str, max_length: int | None = None) -> ShardIndex:
    """Decode and validate the index JSON; frames must tile [len(MAGIC), index_offset) exactly.

    `max_length`: the longest sample the cache declares (manifest `options.max_len`); longer claimed
    lengths are refused before anything is decoded, as are frames over MAX_FRAME_BYTES decoded."""
    d = load_json(raw, f"{where}: index")
    if not isinstance(d, dict) or d.get("format") != SHARD_FORMAT:
        raise ShardError(f"{where}: index format is not {SHARD_FORMAT!r}")
    version = d.get("version")
    if type(version) is not int or not 1 <= version <= SHARD_VERSION:
        raise ShardError(
            f"{where}: shard version {version!r} not supported (reads 1..{SHARD_VERSION}); upgrade dflash"
        )
    try:
        codec = codec_from_dict(d.get("codec"))
    except ValueError as exc:
        raise ShardError(f"{where}: index codec: {exc}") from None
    layers = d.get("layers")
    if not isinstance(layers, list) or not all(type(i) is int and i >= 0 for i in layers):
        raise ShardError(f"{where}: index 'layers' must be a list of non-negative ints, got {layers!r}")
    if len(set(layers)) != len(layers):
        raise ShardError(f"{where}: index 'layers' has duplicates: {layers}")
    dtype = d.get("dtype")
    if dtype not in DTYPES:
        raise ShardError(f"{where}: index dtype {dtype!r} is not one of {sorted(DTYPES)}")
    hidden = _int(d.get("hidden_size"), f"{where}: index hidden_size", 1, 1 << 24)
    meta = d.get("meta", {})
    if not isinstance(meta, dict):
        raise ShardError(f"{where}: index 'meta' must be an object")
    samples = d.get("samples")
    if not isinstance(samples, list):
        raise ShardError(f"{where}: index 'samples' must be a list")
    n_frames = len(FIXED_FRAMES) + len(layers)
    layer_bytes_per_token = codec.decoded_bytes(1, hidden, dtype)
    pos = len(MAGIC)
    entries = []
    for i, s in enumerate(samples):
        what = f"{where}: sample {i}"
        if not isinstance(s, dict):
            raise ShardError(f"{what}: index entry must be an object")
        row = _int(s.get("row"), f"{what} row")
        length = _int(s.get("length"), f"{what} (row {row}) length", 1, 1 << 40)
        if max_length is not None and length > max_length:
            raise ShardError(
                f"{what} (row {row}): length {length} exceeds the {max_length} tokens the cache declares "
                "(manifest options.max_len): refusing to decode it"
            )
        supervised = _int(s.get("supervised"), f"{what} (row {row}) supervised", 0, length)
        frames = s.get("frames")
        if not isinstance(frames, list) or len(frames) != n_frames:
            raise ShardError(f"{what} (row {row}): expected {n_frames} frames, got {frames!r:.80}")
        parsed = []
        for k, fr in enumerate(frames):
            fwhat = f"{what} (row {row}) frame {k}"
            if not isinstance(fr, list) or len(fr) != 3:
                raise ShardError(f"{fwhat}: expected [offset, length, checksum], got {fr!r:.80}")
            off = _int(fr[0], f"{fwhat} offset")
            ln = _int(fr[1], f"{fwhat} length")
            if off != pos:
                kind = "a hole before it" if off > pos else "overlaps the previous frame"
                raise ShardError(f"{fwhat}: offset {off} leaves {kind} (expected {pos})")
            if ln > index_offset - pos:
                raise ShardError(f"{fwhat}: {off}+{ln} runs past the data region (ends at {index_offset})")
            if not isinstance(fr[2], str) or len(fr[2]) != 16:
                raise ShardError(f"{fwhat}: checksum must be 16 hex digits, got {fr[2]!r:.40}")
            decoded = length * (4 if k == 0 else 1 if k == 1 else layer_bytes_per_token)
            if decoded > MAX_FRAME_BYTES:
                raise ShardError(
                    f"{fwhat}: decodes to {decoded} bytes (length {length}), over the {MAX_FRAME_BYTES}-byte "
                    "ceiling of one frame"
                )
            if decoded > max_decoded(ln):
                raise ShardError(
                    f"{fwhat}: {ln} bytes cannot decode to the {decoded} bytes that length {length} needs"
                )
            pos += ln
            parsed.append((off, ln, fr[2]))
        entries.append(Entry(row=row, length=length, supervised=supervised, frames=tuple(parsed)))
    if pos != index_offset:
        raise ShardError(
            f"{where}: frames end at {pos} but the index starts at {index_offset}: unindexed bytes"
        )
    return ShardIndex(codec=codec, layers=layers, dtype=dtype, hidden_size=hidden, meta=meta, entries=entries)
