"""Read shard files: index without decompression, one sample or a layer subset, sequential iteration (a
cache directory of them is `cache.Cache`).

Every read is an `os.pread` on a shared descriptor (no file position), or a range request on object storage
(`remote_cache.RemoteFile`), so readers are safe to share between threads; decompression releases the GIL, so N
threads decode on ~N cores.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from .codecs import Codec, Fp8Block, zstd_decompress_exact
from .errors import CorruptFrame, ShardError
from .layout import FOOTER, MAGIC, Entry, checksum, frame_names, index_checksum, parse_footer, parse_index
from .manifest import ShardInfo
from .safe_io import open_regular
from .trust import NO_LIMITS, ReadLimits


@dataclass(slots=True)
class Sample:
    """One dataset row: ids [S] int64, loss mask [S] bool, hidden states {layer id: [S, H]}."""

    row: int
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden: dict[int, torch.Tensor]  # Fp8Block/QBlock values when read with dequantize=False (fp8, q4, q6)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


def _pread_exact(fd: int, size: int, offset: int, where: str) -> bytes | bytearray:
    """Exactly `size` bytes at `offset`; loops because one pread returns at most ~2 GiB on Linux."""
    data = os.pread(fd, size, offset)
    if len(data) == size:
        return data
    buf = bytearray(size)
    buf[: len(data)] = data
    view, pos = memoryview(buf), len(data)
    while pos < size:
        n = os.preadv(fd, [view[pos:]], offset + pos) if data else 0
        if n == 0:
            raise ShardError(
                f"{where}: wanted {size} bytes at offset {offset}, file ended after {pos}: truncated"
            )
        pos += n
    return buf


class LocalFile:
    """A regular file read by `pread` on one shared descriptor (what `ShardReader` reads on a local disk)."""

    def __init__(self, path: Path):
        self.path = path
        self._fd = open_regular(path, "shard")  # a FIFO or directory is refused here, not hung on or read
        self.size = os.fstat(self._fd).st_size

    def pread(self, size: int, offset: int) -> bytes | bytearray:
        return _pread_exact(self._fd, size, offset, str(self.path))

    def advise_sequential(self) -> None:
        if hasattr(os, "posix_fadvise") and self._fd >= 0:  # ask the kernel for big readahead
            with contextlib.suppress(OSError):
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


class RangeFile(Protocol):
    """What a shard is read through: a local file (`LocalFile`) or an object (`remote_cache.RemoteFile`)."""

    size: int

    def pread(self, size: int, offset: int) -> bytes | bytearray: ...
    def advise_sequential(self) -> None: ...
    def close(self) -> None: ...


class ShardReader:
    """One committed shard; open with `ShardReader.open(path)` (a local file) or `open_file` (any `RangeFile`)."""

    def __init__(
        self,
        path: Path | str,
        file: RangeFile,
        file_size: int,
        index_offset: int,
        raw_index: bytes,
        limits: ReadLimits = NO_LIMITS,
        name: str | None = None,
    ):
        # Parsed before owning the file: open_file() closes it on failure.
        idx = parse_index(raw_index, index_offset, str(path), max_length=limits.max_length)
        self.limits = limits
        self.path = path  # a local Path, or the object's URL (a str) for messages
        self.name = name or Path(path).name
        self._file = file
        self.file_size = file_size
        self.index_offset = index_offset
        self.index_checksum = f"{index_checksum(raw_index):016x}"
        self.codec: Codec = idx.codec
        self.layers: list[int] = idx.layers
        self.dtype: str = idx.dtype
        self.hidden_size: int = idx.hidden_size
        self.meta = idx.meta
        self.entries: list[Entry] = idx.entries
        self.rows = np.fromiter((e.row for e in idx.entries), np.int64, len(idx.entries))  # dataset row ids
        self._layer_pos = {layer: k for k, layer in enumerate(self.layers)}
        self._frame_names = frame_names(self.layers)

    @classmethod
    def open(cls, path: str | os.PathLike, limits: ReadLimits = NO_LIMITS) -> ShardReader:
        """Open and validate a shard; `limits` (from the cache's manifest) bound what its index may claim."""
        path = Path(path)
        return cls.open_file(LocalFile(path), path, limits)

    @classmethod
    def open_file(
        cls, file: RangeFile, path: Path | str, limits: ReadLimits = NO_LIMITS, name: str | None = None
    ) -> ShardReader:
        """`open` of a shard read through `file` (owned from now on: closed on failure and by `close`)."""
        try:
            size = file.size
            if size < len(MAGIC) + FOOTER.size:
                raise ShardError(f"{path}: {size} bytes is too small for a shard: truncated")
            # A remote file reads footer and index in one request (`tail_hint`), a small one whole with its magic;
            # a local one reads the footer.
            tail_start = size - max(FOOTER.size, min(size, getattr(file, "tail_hint", 0)))
            tail = file.pread(size - tail_start, tail_start)
            head = tail[: len(MAGIC)] if tail_start == 0 else file.pread(len(MAGIC), 0)
            if bytes(head) != MAGIC:
                raise ShardError(f"{path}: bad magic: not a dflash shard")
            offset, length, digest = parse_footer(tail[-FOOTER.size :], size, str(path))
            if offset >= tail_start:  # length <= file size: checked by the footer
                raw = bytes(tail[offset - tail_start : offset - tail_start + length])
            else:
                raw = file.pread(length, offset)
            if index_checksum(raw) != digest:
                raise ShardError(f"{path}: index checksum mismatch: the index is corrupt")
            return cls(path, file, size, offset, raw, limits, name)
        except BaseException:
            file.close()
            raise

    def info(self) -> ShardInfo:
        return ShardInfo(
            name=self.name,
            rows=len(self.entries),
            tokens=sum(e.length for e in self.entries),
            supervised=sum(e.supervised for e in self.entries),
            bytes=self.file_size,
            index_checksum=self.index_checksum,
        )

    def __len__(self) -> int:
        return len(self.entries)

    def _layer_slots(self, layers: Sequence[int] | None) -> list[int]:
        if layers is None:
            return list(self.layers)
        missing = [i for i in layers if i not in self._layer_pos]
        if missing:
            raise ValueError(f"{self.path}: layers {missing} are not in this cache (it holds {self.layers})")
        return list(layers)

    def _decode(
        self, i: int, entry: Entry, k: int, buf: bytes | memoryview, dequantize: bool = True, rows: int = 0
    ) -> torch.Tensor | Fp8Block:
        """Frame k of sample i, checksum verified, cut to its first `rows` tokens (0: all of them)."""
        offset, length, digest = entry.frames[k]
        where = f"{self.path}: sample {i} (row {entry.row}) frame {self._frame_names[k]} at {offset}+{length}"
        if checksum(buf) != digest:
            raise CorruptFrame(
                f"{where}: checksum mismatch: the shard is corrupt (run `dflash-shards verify`)"
            )
        s = entry.length
        m = min(rows, s) if rows else s
        try:
            if k == 0:
                raw = zstd_decompress_exact(buf, 4 * s, "input_ids", keep=4 * m)
                ids = np.frombuffer(raw, dtype="<i4")
                problem = self.limits.ids_problem(ids)
                if problem:
                    raise CorruptFrame(problem)
                return torch.from_numpy(ids.astype(np.int64))
            if k == 1:
                raw = np.frombuffer(zstd_decompress_exact(buf, s, "loss_mask", keep=m), dtype=np.uint8)
                if raw.max() > 1:
                    raise CorruptFrame("loss_mask holds values other than 0/1")
                return torch.from_numpy(raw.astype(np.bool_))
            if not dequantize and self.codec.device_decode:
                return self.codec.decode_block(buf, (s, self.hidden_size), rows=m)
            if m < s:
                return self.codec.decode_rows(buf, (s, self.hidden_size), self.dtype, m)
            return self.codec.decode(buf, (s, self.hidden_size), self.dtype)
        except CorruptFrame as exc:
            raise CorruptFrame(f"{where}: {exc}") from None

    def read(
        self,
        i: int,
        layers: Sequence[int] | None = None,
        *,
        dequantize: bool = True,
        max_tokens: int | None = None,
    ) -> Sample:
        """Sample number `i` of this shard (all layers, or only `layers`), checksums verified.

        `max_tokens` cuts the sample to its first tokens while decoding: the rest is never decompressed
        (a training run's --max-length bounds its memory, whatever length the index claims).
        `dequantize=False` on an fp8 or q4/q6 cache returns `Fp8Block`s or `QBlock`s in `hidden` (fewer bytes
        to move; the trainer decodes them on its GPU); other codecs ignore it."""
        if not 0 <= i < len(self.entries):
            raise IndexError(f"{self.path}: sample {i} out of range (shard holds {len(self.entries)})")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        entry = self.entries[i]
        wanted = self._layer_slots(layers)
        if layers is None:  # everything: one contiguous read
            span = self._file.pread(entry.end - entry.start, entry.start)
            view = memoryview(span)
            bufs = [view[off - entry.start : off - entry.start + ln] for off, ln, _ in entry.frames]
        else:
            slots = [0, 1, *(2 + self._layer_pos[layer] for layer in wanted)]
            bufs = [None] * len(entry.frames)
            if getattr(
                self._file, "coalesce", False
            ):  # one range request: a round trip costs more than bytes
                last = max(slots)
                end = entry.frames[last][0] + entry.frames[last][1]
                view = memoryview(self._file.pread(end - entry.start, entry.start))
                for k in slots:
                    off, ln, _ = entry.frames[k]
                    bufs[k] = view[off - entry.start : off - entry.start + ln]
            else:
                for k in slots:
                    off, ln, _ = entry.frames[k]
                    bufs[k] = self._file.pread(ln, off)
        rows = max_tokens or 0
        hidden = {
            layer: self._decode(
                i, entry, 2 + self._layer_pos[layer], bufs[2 + self._layer_pos[layer]], dequantize, rows
            )
            for layer in wanted
        }
        return Sample(
            row=entry.row,
            input_ids=self._decode(i, entry, 0, bufs[0], rows=rows),
            loss_mask=self._decode(i, entry, 1, bufs[1], rows=rows),
            hidden=hidden,
        )

    def iter(
        self, layers: Sequence[int] | None = None, start: int = 0, *, dequantize: bool = True
    ) -> Iterator[Sample]:
        """Samples in file order from `start`; holds one sample at a time."""
        self._file.advise_sequential()
        for i in range(start, len(self.entries)):
            yield self.read(i, layers, dequantize=dequantize)

    def __iter__(self) -> Iterator[Sample]:
        return self.iter()

    def raw_frames(self, i: int) -> list[memoryview]:
        """Sample i's stored frame bytes (one read), unchecked: for `verify`, which checks them itself."""
        entry = self.entries[i]
        view = memoryview(self._file.pread(entry.end - entry.start, entry.start))
        return [view[off - entry.start : off - entry.start + ln] for off, ln, _ in entry.frames]

    def frame_name(self, k: int) -> str:
        return self._frame_names[k]

    def verify(self) -> list[str]:
        """Re-hash every frame; returns one line per bad frame (empty if the shard is sound)."""
        problems = []
        for i, entry in enumerate(self.entries):
            for k, (off, ln, digest) in enumerate(entry.frames):
                try:
                    data = self._file.pread(ln, off)
                except ShardError:
                    data = None
                if data is None or checksum(data) != digest:
                    problems.append(
                        f"{self.path}: sample {i} (row {entry.row}) frame {self._frame_names[k]} "
                        f"at {off}+{ln}: checksum mismatch"
                    )
        return problems

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            self.close()
