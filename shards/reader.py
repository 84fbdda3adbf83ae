"""Read caches and shards: index without decompression, one sample or a layer subset, sequential iteration.

Every read is an `os.pread` on a shared descriptor (no file position), so readers are safe to share
between threads; decompression releases the GIL, so N threads decode on ~N cores.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .codecs import Codec, Fp8Block, codec_from_dict, zstd_decompress_exact
from .errors import CorruptFrame, ShardError
from .layout import FOOTER, MAGIC, Entry, checksum, frame_names, index_checksum, parse_footer, parse_index
from .manifest import Manifest, ShardInfo, load_manifest
from .paths import SHARDS_DIR
from .safe_io import open_regular
from .trust import NO_LIMITS, ReadLimits, check_manifest_for_reading, check_shard_identity, check_shard_layout


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


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """Where a row lives: its shard file name and position in that shard's index."""

    row: int
    length: int
    supervised: int
    shard: str
    index: int


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


class ShardReader:
    """One committed shard file; open with `ShardReader.open(path)`."""

    def __init__(
        self,
        path: Path,
        fd: int,
        file_size: int,
        index_offset: int,
        raw_index: bytes,
        limits: ReadLimits = NO_LIMITS,
    ):
        # Parsed before owning fd: open() closes it on failure.
        idx = parse_index(raw_index, index_offset, str(path), max_length=limits.max_length)
        self.limits = limits
        self.path = path
        self.name = path.name
        self._fd = fd
        self.file_size = file_size
        self.index_offset = index_offset
        self.index_checksum = f"{index_checksum(raw_index):016x}"
        self.codec: Codec = idx.codec
        self.layers: list[int] = idx.layers
        self.dtype: str = idx.dtype
        self.hidden_size: int = idx.hidden_size
        self.meta = idx.meta
        self.entries: list[Entry] = idx.entries
        self._layer_pos = {layer: k for k, layer in enumerate(self.layers)}
        self._frame_names = frame_names(self.layers)

    @classmethod
    def open(cls, path: str | os.PathLike, limits: ReadLimits = NO_LIMITS) -> ShardReader:
        """Open and validate a shard; `limits` (from the cache's manifest) bound what its index may claim."""
        path = Path(path)
        fd = open_regular(path, "shard")  # a FIFO or directory is refused here, not hung on or read
        try:
            size = os.fstat(fd).st_size
            if size < len(MAGIC) + FOOTER.size:
                raise ShardError(f"{path}: {size} bytes is too small for a shard: truncated")
            if _pread_exact(fd, len(MAGIC), 0, str(path)) != MAGIC:
                raise ShardError(f"{path}: bad magic: not a dflash shard")
            footer = _pread_exact(fd, FOOTER.size, size - FOOTER.size, str(path))
            offset, length, digest = parse_footer(footer, size, str(path))
            raw = _pread_exact(fd, length, offset, str(path))  # length <= file size: checked by the footer
            if index_checksum(raw) != digest:
                raise ShardError(f"{path}: index checksum mismatch: the index is corrupt")
            return cls(path, fd, size, offset, raw, limits)
        except BaseException:
            os.close(fd)
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
            span = _pread_exact(self._fd, entry.end - entry.start, entry.start, str(self.path))
            view = memoryview(span)
            bufs = [view[off - entry.start : off - entry.start + ln] for off, ln, _ in entry.frames]
        else:
            slots = [0, 1, *(2 + self._layer_pos[layer] for layer in wanted)]
            bufs = [None] * len(entry.frames)
            for k in slots:
                off, ln, _ = entry.frames[k]
                bufs[k] = _pread_exact(self._fd, ln, off, str(self.path))
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
        if hasattr(os, "posix_fadvise") and self._fd >= 0:  # ask the kernel for big readahead
            with contextlib.suppress(OSError):
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        for i in range(start, len(self.entries)):
            yield self.read(i, layers, dequantize=dequantize)

    def __iter__(self) -> Iterator[Sample]:
        return self.iter()

    def raw_frames(self, i: int) -> list[memoryview]:
        """Sample i's stored frame bytes (one read), unchecked: for `verify`, which checks them itself."""
        entry = self.entries[i]
        view = memoryview(_pread_exact(self._fd, entry.end - entry.start, entry.start, str(self.path)))
        return [view[off - entry.start : off - entry.start + ln] for off, ln, _ in entry.frames]

    def frame_name(self, k: int) -> str:
        return self._frame_names[k]

    def verify(self) -> list[str]:
        """Re-hash every frame; returns one line per bad frame (empty if the shard is sound)."""
        problems = []
        for i, entry in enumerate(self.entries):
            for k, (off, ln, digest) in enumerate(entry.frames):
                try:
                    data = _pread_exact(self._fd, ln, off, str(self.path))
                except ShardError:
                    data = None
                if data is None or checksum(data) != digest:
                    problems.append(
                        f"{self.path}: sample {i} (row {entry.row}) frame {self._frame_names[k]} "
                        f"at {off}+{ln}: checksum mismatch"
                    )
        return problems

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            self.close()


class Cache:
    """A cache directory; open with `Cache.open(path)`. Shards open lazily and are shared by threads."""

    def __init__(
        self,
        path: Path,
        manifest: Manifest,
        shard_names: list[str],
        from_manifest: bool,
        max_open_shards: int,
    ):
        if max_open_shards < 1:
            raise ValueError(f"max_open_shards must be >= 1, got {max_open_shards}")
        self.path = path
        self.manifest = manifest
        self.shard_names = shard_names
        self._known = set(shard_names)
        self._listed = {s.name: s for s in manifest.shards}
        self._from_manifest = from_manifest
        self._max_open = max_open_shards
        self.limits = ReadLimits.of(manifest)
        self._lock = threading.Lock()
        # Most recently used readers; an evicted reader closes its descriptor when the last thread
        # still holding it lets go (reference counting), so eviction never breaks a read in flight.
        self._readers: OrderedDict[str, ShardReader] = OrderedDict()
        self._rows: dict[int, tuple[str, int]] | None = None

    @classmethod
    def open(
        cls, path: str | os.PathLike, require_complete: bool = True, *, max_open_shards: int = 64
    ) -> Cache:
        """Complete caches list shards from the manifest (no directory scan, no footer read until used);
        `require_complete=False` lists the committed `shards/shard-*.dfs` instead (resume, verify).
        At most `max_open_shards` readers (file descriptors + parsed indexes) stay cached."""
        path = Path(path)
        manifest = load_manifest(path)
        check_manifest_for_reading(manifest, f"{path}/manifest.json")
        if manifest.complete:
            names = [s.name for s in manifest.shards]
            return cls(path, manifest, names, True, max_open_shards)
        if require_complete:
            raise ShardError(
                f"{path}: cache is incomplete (extraction running or interrupted): resume the extraction, "
                "or open with require_complete=False to read what is committed"
            )
        shard_dir = path / SHARDS_DIR
        names = sorted(p.name for p in shard_dir.glob("shard-*.dfs")) if shard_dir.is_dir() else []
        return cls(path, manifest, names, False, max_open_shards)

    @property
    def layers(self) -> list[int]:
        return list(self.manifest.layers)

    @property
    def codec(self) -> Codec:
        return codec_from_dict(self.manifest.codec)

    @property
    def shard_infos(self) -> list[ShardInfo]:
        """Per-shard stats: from the manifest when complete, else from each shard's footer."""
        if self._from_manifest:
            return list(self.manifest.shards)
        return [self.shard(n).info() for n in self.shard_names]

    def shard(self, name: str) -> ShardReader:
        with self._lock:
            reader = self._readers.get(name)
            if reader is not None:
                self._readers.move_to_end(name)
                return reader
            if name not in self._known:
                raise KeyError(f"{self.path}: no shard named {name!r}")
        reader = ShardReader.open(self.path / SHARDS_DIR / name, self.limits)  # outside the lock: disk I/O
        try:
            check_shard_layout(reader.path, self.manifest, reader.codec.to_dict(), reader.layers,
                               reader.dtype, reader.hidden_size)  # fmt: skip
            if self._from_manifest:
                check_shard_identity(reader.path, self._listed[name], reader.info())
        except ShardError:
            reader.close()
            raise
        with self._lock:
            reader = self._readers.setdefault(name, reader)
            self._readers.move_to_end(name)
            while len(self._readers) > self._max_open:
                self._readers.popitem(last=False)
            return reader

    def entries(self) -> list[CacheEntry]:
        """Every sample (row, length, supervised, shard, index) from the shard indexes; reads all footers."""
        out = []
        for name in self.shard_names:
            for i, e in enumerate(self.shard(name).entries):
                out.append(
                    CacheEntry(row=e.row, length=e.length, supervised=e.supervised, shard=name, index=i)
                )
        return out

    def locate(self, row: int) -> CacheEntry:
        with self._lock:
            rows = self._rows
        if rows is None:
            rows = {e.row: (e.shard, e.index) for e in self.entries()}
            with self._lock:
                self._rows = rows
        if row not in rows:
            raise KeyError(f"{self.path}: row {row} is not in this cache")
        name, i = rows[row]
        e = self.shard(name).entries[i]
        return CacheEntry(row=row, length=e.length, supervised=e.supervised, shard=name, index=i)

    def read(self, row: int, layers: Sequence[int] | None = None, *, dequantize: bool = True) -> Sample:
        """The sample of dataset row `row` (first call builds the row map from all indexes)."""
        e = self.locate(row)
        return self.shard(e.shard).read(e.index, layers, dequantize=dequantize)

    def close(self) -> None:
        with self._lock:
            for r in self._readers.values():
                r.close()
            self._readers.clear()

    def __enter__(self) -> Cache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
