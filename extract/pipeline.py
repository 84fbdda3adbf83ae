"""`run_extraction(config)`: dataset -> plan -> (resumable, multi-process) staged extraction -> one cache.

Order of a run (each rank): read the target's config, open + validate the dataset, plan batches and
work units (deterministic), take this rank's lock; rank 0 checks or writes the manifest (refusing a
cache made with other settings), checks free disk space, copies the frozen target parts (or keeps
those the manifest's digests vouch for) and records their digests, and marks the cache ready; other
ranks wait for that. Each rank then extracts its uncommitted units
(u % world_size == rank) through the stages of `stages.py`. Rank 0 finally waits for the others
(taking over the units of ranks that died), and finalizes the manifest when every unit is committed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from dflash.shards.codecs import get_codec
from dflash.shards.locks import remove_stale_temp_files
from dflash.shards.manifest import Manifest, ShardInfo, save_manifest
from dflash.shards.outdir import claim_out_dir
from dflash.shards.paths import MANIFEST_NAME, shard_name, shard_path
from dflash.shards.progress import progress_bar
from dflash.shards.published import published_shards
from dflash.shards.reader import ShardReader
from dflash.shards.sizes import raw_state_bytes
from dflash.shards.threads import keep_own_threads, one_torch_thread
from dflash.shards.writer import ShardMeta

from .config import STAGED_UNITS, ExtractConfig
from .nonfinite import skipped_in_shard
from .plan import BatchPlan, WorkUnit
from .prepare import PreparedRun, cache_manifest, prepare
from .result import ExtractResult, format_summary
from .stages import Channel, GpuStep, StageStats, Stopped, drain, load_batches, write_shards
from .target import CapturingTarget, load_target
from .target_parts import write_target_parts
from .units import (
    RankInfo,
    RunLocks,
    assign_units,
    check_or_write_manifest,
    committed_units,
    drop_unreadable_shards,
    reopen_for_lost_shards,
    wait_for_claim,
    wait_for_other_ranks,
)

log = logging.getLogger(__name__)
GB = 1e9


def resolve_device(device: str, local_rank: int) -> torch.device:
    if device == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if device == "cuda":
        return torch.device(f"cuda:{local_rank}")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]


@dataclass(slots=True)
class _Setup:
    """Everything derived from the config before any weights are loaded."""

    config: ExtractConfig
    rank: RankInfo
    device: torch.device
    dtype: torch.dtype
    run: PreparedRun
    codec: Any
    manifest: Manifest
    meta: ShardMeta

    @property
    def layers(self) -> list[int]:
        return self.run.layers

    @property
    def units(self) -> list[WorkUnit]:
        return self.run.units

    @property
    def batches(self) -> BatchPlan:
        return self.run.batches


def _prepare(config: ExtractConfig, rank: RankInfo) -> _Setup:
    device = resolve_device(config.device, rank.local_rank)
    dtype = resolve_dtype(config.dtype, device)
    compute_dtype = str(dtype).removeprefix("torch.")
    run = prepare(config, compute_dtype)
    manifest = cache_manifest(config, run, compute_dtype=compute_dtype)
    codec = get_codec(config.codec)
    meta = ShardMeta(codec=codec, layers=run.layers, hidden_size=run.target.hidden_size, dtype=manifest.dtype)
    return _Setup(config, rank, device, dtype, run, codec, manifest, meta)


def _check_disk(s: _Setup, committed: set[int]) -> None:
    out = s.config.out
    left = sorted((u.est_bytes for u in s.units if u.index not in committed), reverse=True)
    # Published to object storage, the staging directory holds only the shards in flight or awaiting upload.
    need = sum(left[:STAGED_UNITS] if s.config.publish_to else left)
    free = shutil.disk_usage(out).free
    if need > free and not s.config.force:
        raise ValueError(
            f"the cache needs about {need / GB:,.1f} GB more but {out} has {free / GB:,.1f} GB free; "
            "free space, choose --codec fp8 or another --out, or pass --force to start anyway"
        )


def _run_units(s: _Setup, target: Any, unit_ids: list[int], stats: StageStats, show_progress: bool) -> None:
    """Push the given units through the stages; raises the first stage error (e.g. DiskFull)."""
    cfg = s.config
    cuda = s.device.type == "cuda"
    stop = threading.Event()
    q_in, q_out, q_write = (Channel(cfg.queue_depth, stop) for _ in range(3))
    errors: list[BaseException] = []
    work = [(u, s.batches[s.units[u].batch_start : s.units[u].batch_stop]) for u in unit_ids]
    rows = sum(s.units[u].num_rows for u in unit_ids)
    threads_n = cfg.num_encode_threads or max(1, min(16, (os.cpu_count() or 2) - 1))
    lock = threading.Lock()

    def add_encode(dt: float) -> None:
        with lock:
            stats.encode_cpu_s += dt

    progress = None
    if show_progress:
        progress = progress_bar("extract", rows, "row")

    def guarded(fn: Any, *args: Any, **kwargs: Any) -> None:
        try:
            one_torch_thread()
            fn(*args, **kwargs)
        except Stopped:
            pass
        except BaseException as exc:
            errors.append(exc)
            stop.set()

    # Raw bytes in the stored dtype (the manifest's), as every size of a cache counts them (sizes.CacheSize).
    raw_per_token = raw_state_bytes(1, len(s.layers), s.run.target.hidden_size, s.manifest.dtype)
    unit_path = lambda u: shard_path(cfg.out, shard_name(u))  # noqa: E731
    keep_own_threads()  # the forward's CPU ops (a CPU target) keep every core
    pool = ThreadPoolExecutor(
        max_workers=threads_n, thread_name_prefix="dflash-encode", initializer=one_torch_thread
    )
    threads = [
        threading.Thread(
            target=guarded,
            name="dflash-loader",
            args=(load_batches, s.run.dataset, work, q_in, stats.clock("gather"), s.device),
        ),
        threading.Thread(
            target=guarded,
            name="dflash-drain",
            args=(drain, q_out, q_write, s.device, pool, s.codec, stats.clock("d2h"), stats, add_encode),
            kwargs={"layers": s.layers, "on_nonfinite": cfg.on_nonfinite},
        ),
        threading.Thread(
            target=guarded,
            name="dflash-writer",
            args=(
                write_shards,
                q_write,
                unit_path,
                s.meta,
                stats.clock("write"),
                stats,
                raw_per_token,
                progress,
            ),
        ),
    ]
    for t in threads:
        t.start()
    step = GpuStep(target, s.codec)
    clock = stats.clock("forward")
    try:
        while True:
            with clock.timing("wait_in"):
                item = q_in.get()
            if item is None:
                break
            t0 = time.perf_counter()
            with clock.timing("busy"):
                item = step(item)
            item.host_ms = (time.perf_counter() - t0) * 1e3
            if not cuda:
                stats.gpu_compute_s += item.host_ms / 1e3
            with clock.timing("wait_out"):
                q_out.put(item)
        q_out.put(None)
    except Stopped:
        pass
    except BaseException as exc:
        errors.append(exc)
        stop.set()
    finally:
        for t in threads:
            while t.is_alive():
                t.join(timeout=0.5)
                if errors:
                    stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        if progress is not None:
            progress.close()
    if not cuda:
        stats.gpu_span_s = clock.busy + clock.wait_in + clock.wait_out
    if errors:
        raise errors[0]


def _finalize(s: _Setup) -> Manifest:
    infos: list[ShardInfo] = []
    nonfinite: list[dict[str, Any]] = []
    published = published_shards(s.config.out)  # uploaded to object storage and deleted here
    for u in range(len(s.units)):
        name = shard_name(u)
        if name not in published:
            try:
                with ShardReader.open(shard_path(s.config.out, name)) as r:
                    infos.append(r.info())
                    nonfinite.extend(skipped_in_shard(r))
                continue
            except FileNotFoundError:  # uploaded and deleted since the record was read
                published = published_shards(s.config.out)
                if name not in published:
                    raise
        infos.append(published[name]["info"])
        nonfinite.extend(published[name]["skipped"])
    if not sum(i.rows for i in infos) and not s.config.allow_empty:
        raise ValueError(
            f"{s.config.out}: every row was skipped ({len(nonfinite)} for non-finite hidden states), the "
            "cache would be empty; fix the target or pass --allow-empty"
        )
    m = Manifest.from_dict(s.manifest.to_dict())
    m.shards = infos
    m.skipped = sorted(s.run.report.skipped_records() + nonfinite, key=lambda r: r["row"])
    m.complete = True
    save_manifest(s.config.out, m)
    return m


def _open_cache(s: _Setup, out: Path, locks: RunLocks) -> bool:
    """Rank 0 checks (or writes) the manifest, cleans up after killed writers, checks free space and writes
    and checks CACHE/target/ (seconds: before any weights load), then tells the other ranks; they check
    the manifest once it is ready. Returns whether the cache is already complete."""
    if s.rank.rank != 0:
        locks.wait_for_rank0()
        return check_or_write_manifest(out, s.manifest, write=False).complete
    current = (
        check_or_write_manifest(out, s.manifest, write=False)
        if os.path.lexists(out / MANIFEST_NAME)
        else None
    )
    if current is not None and current.complete:
        current = reopen_for_lost_shards(out, current)
    if current is None or not current.complete:
        remove_stale_temp_files(out)
        committed = drop_unreadable_shards(out, committed_units(out))
        _check_disk(s, committed)
        current = check_or_write_manifest(out, s.manifest, write=True)
    _target_parts(s, out, current)
    locks.mark_ready()
    return current.complete


def _target_parts(s: _Setup, out: Path, current: Manifest) -> None:
    """CACHE/target/ kept when the manifest's digests vouch for it, else written from the target, and the
    digests of what it holds recorded in the manifest on disk and in the one `_finalize` writes. A complete
    cache too: re-running its command is how target/ damaged since extraction is repaired."""
    files = write_target_parts(out, s.config.target, recorded=current.target_files)
    if files != current.target_files:  # `current` may be `s.manifest` itself (a new cache)
        current.target_files = files
        save_manifest(out, current)
    s.manifest.target_files = files


def run_extraction(
    config: ExtractConfig, *, takeover_grace_s: float = 30.0, target: CapturingTarget | None = None
) -> ExtractResult:
    """Extract (or resume) `config.out` on this process's share of the work; see the module docstring.

    takeover_grace_s: how long rank 0 waits, with units left and no other rank alive, before doing them.
    target: an already loaded `CapturingTarget` for `config.target` (benchmarks build random-weight
    targets in memory); its layer ids must be the ones the config resolves to.
    """
    if config.dry_run or config.out is None:
        raise ValueError("run_extraction needs --out and no --dry-run (the dry run is the CLI's plan report)")
    t_start = time.perf_counter()
    rank = RankInfo.from_env()
    s = _prepare(config, rank)
    if target is not None and list(target.layer_ids) != s.layers:
        raise ValueError(
            f"the preloaded target captures layers {target.layer_ids}, the config asks for {s.layers}"
        )
    extract_s = cpu_s = 0.0
    out = Path(config.out)
    # The --out rule before anything is created or deleted in it (a lock file included).
    if rank.rank == 0:
        claim_out_dir(out, "cache")
    else:
        wait_for_claim(out)
    locks = RunLocks(out, rank)
    locks.acquire()
    stats = StageStats()
    done: list[int] = []
    try:
        complete = already_complete = _open_cache(s, out, locks)
        while not complete:
            mine = assign_units(len(s.units), committed_units(out), rank.rank, rank.world_size)
            if mine:
                if target is None:
                    if s.device.type == "cuda":
                        torch.cuda.set_device(s.device)
                    target = load_target(
                        config.target,
                        s.layers,
                        device=s.device,
                        dtype=s.dtype,
                        trust_remote_code=config.trust_remote_code,
                    )
                for what in target.speed_up(compile=config.compile):
                    log.info("target forward: %s", what)
                t, cpu = time.perf_counter(), time.process_time()
                _run_units(s, target, mine, stats, show_progress=rank.rank == 0)
                extract_s += time.perf_counter() - t
                cpu_s += time.process_time() - cpu
                done.extend(mine)
            if rank.rank != 0:
                break
            if not wait_for_other_ranks(out, len(s.units), locks, takeover_grace_s):
                # Units are left and no other rank is alive: rank 0 takes them over as a world of one.
                rank = RankInfo(rank=0, world_size=1, local_rank=rank.local_rank, run_id=rank.run_id)
                continue
            _finalize(s)
            complete = True
    finally:
        locks.release()
    result = ExtractResult(
        cache=str(out),
        complete=complete,
        rank=s.rank.rank,
        world_size=s.rank.world_size,
        device=str(s.device),
        units_total=len(s.units),
        units_done=len(done),
        units_committed=len(committed_units(out)),
        rows=stats.rows,
        rows_skipped=len(s.run.report.skipped_rows) + stats.rows_nonfinite,
        rows_nonfinite=stats.rows_nonfinite,
        tokens=stats.tokens,
        bytes_written=stats.bytes_written,
        raw_bytes=stats.raw_bytes,
        raw_dtype=s.manifest.dtype,
        already_complete=already_complete,
        seconds=time.perf_counter() - t_start,
        extract_seconds=extract_s,
        cpu_seconds=cpu_s,
        gpu_compute_s=stats.gpu_compute_s,
        gpu_wait_fraction=stats.gpu_wait_fraction,
        encode_cpu_s=stats.encode_cpu_s,
        stages={k: c.to_dict() for k, c in stats.clocks.items()},
        batch_times=stats.batch_times,
    )
    if s.rank.rank == 0:
        print(json.dumps(result.to_dict()) if config.json else format_summary(result), flush=True)
    return result
