"""Re-encode a complete cache with another codec (lossless -> fp8 -> q6 -> q4) without the target.

    convert_cache(ConvertConfig(source=CACHE, out=NEW, codec="q4")) -> ConvertResult

Shard for shard, sample for sample, in the source's order: NEW/shards/shard-NNNNNN.dfs holds exactly the
rows of CACHE's shard of the same name, every layer decoded to bfloat16 and encoded again (on `device`
for the quantizing codecs, like the extractor). Resumable and checked like an extraction:

- NEW follows the `--out` rule of every dflash command (`outdir.claim_out_dir`: new, empty or a dflash
  cache, never inside a cache), claimed before anything is created or deleted in it;
- every source index (not the data) is read before NEW is touched: a row stored in two shards is refused
  (`Cache.check_rows_once`), as training refuses it, instead of being written twice;
- NEW/.lock (fcntl, opened without following links) keeps a second converter out; NEW/manifest.json (complete=false) is written first
  with the source's provenance and the new codec, and a re-run whose settings differ is refused naming
  the field (`codec.name: 'q4' != 'fp8'`, or `options.converted_from...` for another source cache);
- committed shards are kept (after their footer and index checksum read back and their rows agree
  with the source), temp files of a killed run are removed and their shards redone;
- shards are published (fsync, rename) by the writer's Committer while the next one is encoded;
- NEW/target/ (config, frozen embed/lm_head, tokenizer) is copied whole or not at all, from a source whose
  files match its manifest's digests (`target_files`, recorded from the source's files when it has none),
  and the copy is held to the same digests;
- the complete manifest, listing every shard, is written last.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .atomic import commit_dir, fresh_temp_dir
from .cache import Cache
from .codecs import Codec, codec_names, get_codec
from .errors import ShardError
from .locks import remove_stale_temp_files, take_lock
from .manifest import Manifest, ShardInfo, load_manifest, refuse_other_settings, save_manifest
from .outdir import claim_out_dir
from .paths import LOCK_NAME, MANIFEST_NAME, SHARDS_DIR
from .progress import Progress, progress_bar
from .reader import ShardReader
from .sizes import CacheSize, cache_size
from .target_files import check_target_files, digest_files, target_file_problems
from .target_parts import check_target_parts, target_dir
from .threads import torch_threads
from .urls import is_url, local_path
from .writer import Committer, EncodedSample, ShardMeta, ShardWriter, encode_sample


@dataclass(kw_only=True, slots=True)
class ConvertConfig:
    source: Path | str  # a local cache or a URL (s3://bucket/prefix: read by range requests)
    out: Path
    codec: str
    threads: int = 0  # encode threads; 0: one per CPU core
    device: str = "cpu"  # where fp8/q4/q6 quantize (cuda: like the extractor)

    def __post_init__(self) -> None:
        self.source = self.source if is_url(str(self.source)) else Path(self.source)
        self.out = local_path(self.out, "--out")
        if self.codec not in codec_names():
            raise ValueError(f"--codec must be one of {', '.join(codec_names())}; got {self.codec!r}")
        if self.threads < 0:
            raise ValueError(f"--threads must be >= 0 (0: one per core), got {self.threads}")
        if isinstance(self.source, Path) and self.source.resolve() == self.out.resolve():
            raise ValueError(f"--out {self.out} is the source cache: convert writes a new cache beside it")
        check_device(self.device)


def check_device(device: str) -> torch.device:
    """`--device` as a torch device: cpu, or a CUDA device torch can see; anything else is one line."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"--device {device!r}: not a device; use cpu, cuda or cuda:N") from None
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: only cpu and cuda are supported")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device!r}: torch sees no CUDA device; use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {device!r}: torch sees {torch.cuda.device_count()} CUDA device(s) (0.."
                f"{torch.cuda.device_count() - 1})"
            )
    return parsed


@dataclass(kw_only=True, slots=True)
class ConvertResult:
    out: Path
    codec: str
    shards: int
    converted: int  # shards written by this run (the others were committed before)
    rows: int
    raw_bytes: int  # bf16 bytes of the converted layers (what the bench's GB/s counts)
    bytes_in: int
    bytes_out: int
    seconds: float
    size_in: CacheSize  # the source cache and the new one, by the one definition (`sizes.cache_size`)
    size_out: CacheSize

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__slots__ if k not in ("size_in", "size_out")}
        d["out"] = str(self.out)
        for key in ("size_in", "size_out"):
            d[key] = getattr(self, key).to_dict()
        d["gb_per_s"] = self.raw_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
        return d


def converted_manifest(source: Manifest, codec: Codec) -> Manifest:
    """The new cache's provenance: the source's, with the new codec and a record of the conversion."""
    m = Manifest.from_dict(source.to_dict())
    listing = json.dumps([s.to_dict() for s in source.shards], sort_keys=True).encode()
    step = {"codec": source.codec, "shards_sha256": hashlib.sha256(listing).hexdigest()}
    m.options = {**m.options, "converted_from": [*m.options.get("converted_from", []), step]}
    m.codec = codec.to_dict()
    m.dtype = codec.stored_dtype(source.dtype)
    m.complete, m.shards = False, []
    return m


def _start(out: Path, expected: Manifest) -> None:
    """Write the incomplete manifest, or check an existing one against `expected` (resume)."""
    if os.path.lexists(out / MANIFEST_NAME):
        refuse_other_settings(
            load_manifest(out), expected, f"{out} was converted with other settings or from another cache"
        )
        return
    others = [p.name for p in out.iterdir() if not p.name.startswith(".")]
    if others:
        raise ValueError(f"{out} is not empty ({', '.join(sorted(others)[:5])}) and has no manifest.json")
    save_manifest(out, expected)


def _copy_target(source: Path, out: Path, files: dict[str, Any]) -> None:
    """CACHE/target/ -> NEW/target/ whole or not at all (again when a copy left by an earlier run differs
    from `files`, the digests the new manifest records), then checked as extraction checks it."""
    final = target_dir(out)
    if not final.is_dir() or target_file_problems(final, files):
        tmp = fresh_temp_dir(final)  # a link planted under the temp name is removed, never followed
        try:
            shutil.copytree(target_dir(source), tmp, dirs_exist_ok=True)
            commit_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    check_target_files(out, files)  # the copy read back: a read or write error is named here
    check_target_parts(out)


def _committed_info(path: Path, source: ShardInfo) -> ShardInfo | None:
    """A committed output shard's info if it reads back (footer, index checksum) and holds the source
    shard's rows and tokens; None otherwise."""
    try:
        with ShardReader.open(path) as r:
            info = r.info()
    except (ShardError, OSError):
        return None
    same = (info.rows, info.tokens, info.supervised) == (source.rows, source.tokens, source.supervised)
    return info if same else None


# Samples quantized in one call, up to this many elements per layer. Each torch op holds the GIL while it is
# dispatched, so on a cache of short rows (~320 tokens x 384) per-sample calls were all overhead and 16
# encode threads converted at 0.16 GB/s, the speed of one; grouped, each op works on ~2M elements.
GROUP_ELEMENTS = 1 << 21


def sample_groups(lengths: Sequence[int], hidden: int, limit: int = GROUP_ELEMENTS) -> list[range]:
    """Consecutive sample indexes cut into groups of at most `limit` elements (tokens x hidden) per layer;
    a sample larger than `limit` is a group of its own."""
    groups, start, size = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and size + n * hidden > limit:
            groups.append(range(start, i))
            start, size = i, 0
        size += n * hidden
    if start < len(lengths):
        groups.append(range(start, len(lengths)))
    return groups


def _encode_group(
    reader: ShardReader, indexes: range, codec: Codec, device: torch.device
) -> list[tuple[EncodedSample, int]]:
    """Samples `indexes` of a shard decoded and encoded with `codec`, quantized together as the extractor
    quantizes a batch (`quantize_batch`: per-row statistics, so each sample's bytes are what encoding it
    alone gives)."""
    samples = [reader.read(i) for i in indexes]
    lengths = [s.length for s in samples]
    packed = torch.stack([torch.cat([s.hidden[layer] for s in samples]) for layer in reader.layers])
    parts = codec.quantize_batch(packed.to(device), lengths)
    parts = tuple(p.cpu() for p in parts)  # one copy per group, not one round trip per sample and layer
    out, offset = [], 0
    for i, sample in enumerate(samples):
        layers = codec.batch_sample(parts, lengths, i, offset)
        offset += lengths[i]
        raw = lengths[i] * reader.hidden_size * len(layers) * 2
        out.append((encode_sample(codec, sample.row, sample.input_ids, sample.loss_mask, layers), raw))
    return out


def _convert_shard(
    reader: ShardReader,
    path: Path,
    codec: Codec,
    pool: ThreadPoolExecutor,
    window: int,
    device: torch.device,
    progress: Progress,
) -> tuple[ShardWriter, int]:
    """Stream one shard's sample groups through the pool (at most `window` in flight), in order, into a
    writer."""
    meta = ShardMeta(
        codec=codec,
        layers=reader.layers,
        hidden_size=reader.hidden_size,
        dtype=codec.stored_dtype(reader.dtype),
        extra=reader.meta,
    )
    writer = ShardWriter(path, meta)
    raw = 0
    pending: deque[Future] = deque()

    def take_oldest() -> None:
        nonlocal raw
        for sample, n in pending.popleft().result():
            writer.append(sample)
            raw += n
            progress.update(1)

    try:
        for indexes in sample_groups([e.length for e in reader.entries], reader.hidden_size):
            pending.append(pool.submit(_encode_group, reader, indexes, codec, device))
            if len(pending) >= window:
                take_oldest()
        while pending:
            take_oldest()
        writer.finish()
    except BaseException:
        for f in pending:
            f.cancel()
        writer.abort()
        raise
    return writer, raw


def convert_cache(config: ConvertConfig) -> ConvertResult:
    """Convert (or resume converting) `config.source` into `config.out`; see the module docstring."""
    t0 = time.perf_counter()
    codec = get_codec(config.codec)
    device = check_device(config.device)
    with Cache.open(config.source) as source:
        if codec == source.codec:
            raise ValueError(f"{config.source} is already stored with codec {config.codec!r}")
        # Training needs them: refuse a source without them, or unlike its record, before any work.
        check_target_files(source.path, source.manifest.target_files)  # a remote cache's local copy
        check_target_parts(source.path)
        source.check_rows_once()  # every index (not the data) read now: a row in two shards refused up front
        expected = converted_manifest(source.manifest, codec)
        if not expected.target_files:  # a source from before digests: record what is copied
            expected.target_files = digest_files(target_dir(source.path))
        claim_out_dir(config.out, "cache")  # the --out rule, before anything is created or deleted
        lock = take_lock(
            config.out / LOCK_NAME, f"{config.out} is being written by another process", command="convert"
        )
        try:
            _start(config.out, expected)
            shard_dir = config.out / SHARDS_DIR
            shard_dir.mkdir(exist_ok=True)
            remove_stale_temp_files(config.out)
            _copy_target(source.path, config.out, expected.target_files)
            threads = config.threads or max(1, os.cpu_count() or 1)
            converted, raw = 0, 0
            progress = progress_bar("convert", sum(i.rows for i in source.shard_infos), "row")
            # The encode threads are the parallelism: torch's intra-op threads on top of them oversubscribe
            # the cores (q4 on 2 cores: 0.06 GB/s with torch's default against 0.13 with one thread).
            with (
                torch_threads(1),
                ThreadPoolExecutor(threads, thread_name_prefix="dflash-convert") as pool,
                Committer() as committer,
                contextlib.closing(progress),
            ):
                for info in source.shard_infos:
                    path = shard_dir / info.name
                    if path.exists():
                        if _committed_info(path, info) is not None:
                            progress.update(info.rows)
                            continue
                        path.unlink()  # unreadable or not the source's rows: redone
                    writer, n = _convert_shard(
                        source.shard(info.name), path, codec, pool, 2 * threads, device, progress
                    )
                    committer.submit(writer)
                    converted, raw = converted + 1, raw + n
                committer.drain()
            infos = _finalize(config.out, expected, source.shard_infos)
        finally:
            lock.release()
    return ConvertResult(
        out=config.out,
        codec=config.codec,
        shards=len(infos),
        converted=converted,
        rows=sum(i.rows for i in infos),
        raw_bytes=raw,
        bytes_in=sum(i.bytes for i in source.shard_infos),
        bytes_out=sum(i.bytes for i in infos),
        seconds=time.perf_counter() - t0,
        size_in=_size(source.manifest, source.shard_infos),
        size_out=_size(expected, infos),
    )


def _size(m: Manifest, infos: list[ShardInfo]) -> CacheSize:
    return cache_size(infos, len(m.layers), m.hidden_size, m.dtype)


def _finalize(out: Path, expected: Manifest, source_infos: list[ShardInfo]) -> list[ShardInfo]:
    """Every output shard read back and matched against its source; then the complete manifest, last."""
    infos = []
    for src in source_infos:
        info = _committed_info(out / SHARDS_DIR / src.name, src)
        if info is None:
            raise ShardError(f"{out / SHARDS_DIR / src.name}: does not hold the rows of the source shard")
        infos.append(info)
    m = Manifest.from_dict(expected.to_dict())
    m.shards, m.complete = infos, True
    save_manifest(out, m)
    return infos
