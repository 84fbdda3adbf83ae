"""Encode samples into frames (thread-safe, call from a pool) and stream them into one shard file.

A shard is written as `.shard-NNNNNN.dfs.tmp-<pid>` beside its final name, frames streamed to disk as they
are appended; `commit()` = `finish()` (index and footer) then `publish()` (fsync, rename, fsync the
directory), so a shard is either committed whole or absent (a killed writer leaves only a dot-file that
readers never list). `Committer` runs `publish()` on background threads, so the next shard streams to
the disk while the last one is flushed: an fsync waits for the disk, and a writer that waited with it
kept the disk busy only part of the time.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .atomic import fsync_dir
from .codecs import Codec, codec_from_dict, dtype_name, zstd_compress
from .errors import DiskFull, ShardError
from .layout import FOOTER, FOOTER_MAGIC, MAGIC, SHARD_FORMAT, SHARD_VERSION, checksum, index_checksum
from .manifest import ShardInfo
from .paths import SHARD_SUFFIX

log = logging.getLogger(__name__)
_INT32 = np.iinfo(np.int32)
# Frames below this size (token ids, loss masks, short samples) are gathered into one write of up to
# _COALESCE_BYTES; bigger frames are written straight from the encoder's buffer, never copied.
_SMALL_FRAME = 1 << 16
_COALESCE_BYTES = 1 << 20
COMMITS_IN_FLIGHT = 2  # shards being flushed while the next one streams


@dataclass(kw_only=True, slots=True)
class ShardMeta:
    """What every sample of a shard shares; `extra` is free-form JSON (e.g. the work unit id)."""

    codec: Codec
    layers: list[int]
    hidden_size: int
    dtype: str = "bfloat16"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.codec, Mapping):
            self.codec = codec_from_dict(self.codec)
        self.layers = [int(i) for i in self.layers]
        if len(set(self.layers)) != len(self.layers) or any(i < 0 for i in self.layers):
            raise ValueError(f"layers must be distinct non-negative ids, got {self.layers}")
        if self.hidden_size < 1:
            raise ValueError(f"hidden_size must be >= 1, got {self.hidden_size}")
        self.dtype = dtype_name(self.dtype)

    @classmethod
    def coerce(cls, meta: ShardMeta | Mapping[str, Any]) -> ShardMeta:
        return meta if isinstance(meta, ShardMeta) else cls(**dict(meta))


@dataclass(slots=True)
class EncodedSample:
    """One sample's frames (input_ids, loss_mask, then one per layer) with their checksums."""

    row: int
    length: int
    supervised: int
    dtype: str
    hidden_size: int
    codec: dict[str, Any]
    frames: list[bytes | memoryview]
    checksums: list[str]

    @property
    def nbytes(self) -> int:
        return sum(len(f) for f in self.frames)


def _to_numpy(x: torch.Tensor | np.ndarray | Sequence[int]) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def encode_sample(
    codec: Codec,
    row: int,
    input_ids: torch.Tensor | np.ndarray | Sequence[int],
    loss_mask: torch.Tensor | np.ndarray | Sequence[int],
    layers: Sequence[torch.Tensor | np.ndarray | Any],
) -> EncodedSample:
    """Encode and hash one sample (row id, [S] ids, [S] 0/1 mask, one [S, H] per captured layer)."""
    ids = _to_numpy(input_ids)
    mask = _to_numpy(loss_mask)
    if ids.ndim != 1 or ids.size < 1:
        raise ValueError(f"row {row}: input_ids must be a non-empty 1-D array, got shape {ids.shape}")
    s = ids.size
    if not np.issubdtype(ids.dtype, np.integer) or (ids.min() < _INT32.min or ids.max() > _INT32.max):
        raise ValueError(f"row {row}: input_ids must be integers that fit int32 (dtype {ids.dtype})")
    if mask.shape != (s,):
        raise ValueError(f"row {row}: loss_mask shape {mask.shape} != input_ids shape ({s},)")
    mask_u8 = mask.astype(np.uint8)
    if mask_u8.max(initial=0) > 1 or not np.array_equal(mask_u8, mask):
        raise ValueError(f"row {row}: loss_mask must hold only 0/1 (or bool)")
    if row < 0:
        raise ValueError(f"row id must be >= 0, got {row}")
    frames: list[bytes | memoryview] = [
        zstd_compress(ids.astype("<i4").tobytes(), 1),
        zstd_compress(mask_u8.tobytes(), 1),
    ]
    dtype = hidden = None
    for k, x in enumerate(layers):
        shape = tuple(x.shape)
        if len(shape) != 2 or shape[0] != s or shape[1] < 1:
            raise ValueError(f"row {row}: layer #{k} has shape {tuple(shape)}, expected [{s}, H] with H >= 1")
        # a block quantized on the GPU (Fp8Block, QBlock) came from bfloat16 states
        in_dtype = dtype_name(x.dtype) if isinstance(x, torch.Tensor | np.ndarray) else "bfloat16"
        if hidden is None:
            dtype, hidden = codec.stored_dtype(in_dtype), shape[1]
        elif shape[1] != hidden or codec.stored_dtype(in_dtype) != dtype:
            raise ValueError(
                f"row {row}: layer #{k} is {shape}/{in_dtype}, other layers [{s}, {hidden}]/{dtype}"
            )
        frames.append(codec.encode(x))
    if hidden is None:
        raise ValueError(f"row {row}: no layers given")
    return EncodedSample(
        row=int(row),
        length=int(s),
        supervised=int(mask_u8.sum()),
        dtype=dtype,
        hidden_size=int(hidden),
        codec=codec.to_dict(),
        frames=frames,
        checksums=[checksum(f) for f in frames],
    )


class ShardWriter:
    """Streams EncodedSamples into `path` (…/shard-NNNNNN.dfs) via a temp file; commit() makes it visible."""

    def __init__(self, path: str | os.PathLike, meta: ShardMeta | Mapping[str, Any]):
        self.path = Path(path)
        if not self.path.name.endswith(SHARD_SUFFIX):
            raise ValueError(f"shard path {self.path} must end with {SHARD_SUFFIX}")
        self.meta = ShardMeta.coerce(meta)
        self.tmp_path = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self._lock = threading.Lock()
        self._samples: list[dict[str, Any]] = []
        self._tokens = 0
        self._supervised = 0
        self._done = False
        self._finished: ShardInfo | None = None
        self._pending = bytearray()  # small frames not yet written
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:  # "x": a temp name clash means two writers of one unit in one process; never clobber it
            self._file = open(self.tmp_path, "xb", buffering=0)  # noqa: SIM115 - lives until commit/abort
        except OSError as exc:
            self._done = True
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(f"{self.path}: no space left on device to start this shard") from exc
            raise
        self._offset = 0
        self._write(MAGIC)

    @property
    def bytes_written(self) -> int:
        return self._offset

    @property
    def rows(self) -> int:
        return len(self._samples)

    def _guard(self, op):
        try:
            return op()
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self._abort_quietly()
                raise DiskFull(
                    f"{self.path}: no space left on device while writing this shard; it was discarded, "
                    "committed shards are intact: free space and resume"
                ) from exc
            self._abort_quietly()
            raise

    def _write(self, data: bytes | memoryview) -> None:
        n = len(memoryview(data).cast("B"))
        if n < _SMALL_FRAME and len(self._pending) + n <= _COALESCE_BYTES:
            self._pending += data
        else:
            self._flush_pending()
            self._write_now(data)
        self._offset += n

    def _flush_pending(self) -> None:
        if self._pending:
            self._write_now(self._pending)
            self._pending = bytearray()

    def _write_now(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:  # raw file: a short write is possible, loop until all is down
            n = self._guard(lambda v=view: self._file.write(v))
            view = view[n:]

    def append(self, sample: EncodedSample) -> None:
        """Write one sample's frames now (nothing is kept but its index entry)."""
        m = self.meta
        if (
            sample.codec != m.codec.to_dict()
            or sample.hidden_size != m.hidden_size
            or sample.dtype != m.dtype
        ):
            raise ValueError(
                f"{self.path}: row {sample.row} encoded as codec={sample.codec} H={sample.hidden_size} "
                f"dtype={sample.dtype}, shard is codec={m.codec.to_dict()} H={m.hidden_size} dtype={m.dtype}"
            )
        if len(sample.frames) != 2 + len(m.layers):
            raise ValueError(
                f"{self.path}: row {sample.row} has {len(sample.frames) - 2} layers, shard has {m.layers}"
            )
        with self._lock:
            if self._done or self._finished is not None:
                raise ShardError(f"{self.path}: append after commit/abort")
            frames = []
            for data, digest in zip(sample.frames, sample.checksums, strict=True):
                frames.append([self._offset, len(data), digest])
                self._write(data)
            self._samples.append(
                {
                    "row": sample.row,
                    "length": sample.length,
                    "supervised": sample.supervised,
                    "frames": frames,
                }
            )
            self._tokens += sample.length
            self._supervised += sample.supervised

    def finish(self) -> ShardInfo:
        """Write the index and footer: the file is complete, not yet durable nor visible (see publish)."""
        with self._lock:
            if self._done or self._finished is not None:
                raise ShardError(f"{self.path}: finish after commit/abort")
            m = self.meta
            index = {
                "format": SHARD_FORMAT,
                "version": SHARD_VERSION,
                "codec": m.codec.to_dict(),
                "layers": m.layers,
                "dtype": m.dtype,
                "hidden_size": m.hidden_size,
                "meta": m.extra,
                "samples": self._samples,
            }
            raw = json.dumps(index, separators=(",", ":")).encode()
            index_offset = self._offset
            self._write(raw)
            self._write(FOOTER.pack(index_offset, len(raw), index_checksum(raw), FOOTER_MAGIC))
            self._flush_pending()
            self._finished = ShardInfo(
                name=self.path.name,
                rows=len(self._samples),
                tokens=self._tokens,
                supervised=self._supervised,
                bytes=self._offset,
                index_checksum=f"{index_checksum(raw):016x}",
            )
            return self._finished

    def publish(self) -> ShardInfo:
        """fsync, rename to the final name, fsync the directory (any thread, after finish)."""
        with self._lock:
            if self._done or self._finished is None:
                raise ShardError(f"{self.path}: publish before finish or after commit/abort")
            self._guard(lambda: os.fsync(self._file.fileno()))
            # the pages are on disk and nobody reads them back soon: leave the page cache to the readers
            if hasattr(os, "posix_fadvise"):
                with contextlib.suppress(OSError):
                    os.posix_fadvise(self._file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            self._file.close()
            self._guard(lambda: os.replace(self.tmp_path, self.path))
            self._done = True
            fsync_dir(self.path.parent)
            return self._finished

    def commit(self) -> ShardInfo:
        """Index + footer, fsync, rename to the final name, fsync the directory."""
        self.finish()
        return self.publish()

    def _abort_quietly(self) -> None:
        self._done = True
        self._pending = bytearray()
        try:
            if not self._file.closed:
                self._file.close()
        except (OSError, AttributeError):
            pass
        try:
            self.tmp_path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not remove %s: %s", self.tmp_path, exc)

    def abort(self) -> None:
        """Discard the temp file; nothing becomes visible."""
        with self._lock:
            self._abort_quietly()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self._done:
            self.abort()


class Committer:
    """Publishes finished shards on background threads, at most `depth` at a time.

    `submit` returns at once while fewer than `depth` shards are being flushed, else waits for one (the
    disk is behind: the writer must not run ahead of it); a failed publish (disk full at fsync) is raised
    by the next `submit` or by `drain`. Crash safety is the ShardWriter's: a shard is renamed into place
    only after its fsync, so a kill at any moment leaves each shard whole or absent."""

    def __init__(self, depth: int = COMMITS_IN_FLIGHT):
        if depth < 1:
            raise ValueError(f"commit depth must be >= 1, got {depth}")
        self._pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="dflash-commit")
        self._slots = threading.BoundedSemaphore(depth)
        self._futures: list[Future] = []

    def submit(self, writer: ShardWriter) -> None:
        """Publish a finished writer in the background."""
        self._raise_failed()
        self._slots.acquire()
        try:
            future = self._pool.submit(writer.publish)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _: self._slots.release())
        self._futures.append(future)

    def _raise_failed(self) -> None:
        for f in self._futures:
            if f.done() and f.exception() is not None:
                raise f.exception()
        self._futures = [f for f in self._futures if not f.done()]

    def drain(self) -> None:
        """Wait until every submitted shard is published; raise the first failure."""
        for f in self._futures:
            f.result()
        self._futures = []

    def close(self) -> None:
        """Wait for publishes in flight (they end with the shard whole or absent) and stop the threads."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Committer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def stale_temp_files(shards_dir: str | os.PathLike) -> list[Path]:
    """Temp files left by killed writers (`.shard-*.dfs.tmp-<pid>`); the caller decides whether to remove them."""
    d = Path(shards_dir)
    return sorted(d.glob(f".shard-*{SHARD_SUFFIX}.tmp-*")) if d.is_dir() else []
