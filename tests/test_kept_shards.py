"""A remote cache's shards kept on local disk up to a bound (`kept_shards.ShardFileCache`, `--shard-cache-gb`):
what fits is kept, the rest is read by ranges and never downloaded whole again; threads and processes sharing
the directory download a shard once and keep the bound together; stale reservations go; a smaller bound keeps
the most recently used."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from common.synth import make_cache
from dflash.shards import Cache
from dflash.shards.atomic import FOREIGN_STALE_S, host_tag, left_by_dead_process, temp_path
from dflash.shards.cache import MAX_OPEN_SHARDS, default_open_shards
from dflash.shards.kept_shards import ShardFileCache, reservation_name
from dflash.shards.reader import LocalFile
from dflash.shards.remote_cache import RemoteFile
from dflash.shards.storage import open_storage

from bench.bench_reopens import opens_per_shard
from tests.common.s3 import uploaded

ROWS = 12


@pytest.fixture(scope="module")
def local_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kept") / "cache"
    make_cache(path, [40 + 7 * i for i in range(ROWS)], layers=(1, 3), hidden=64, rows_per_shard=2)
    return path


@pytest.fixture
def remote(s3, local_cache: Path) -> str:
    return uploaded(s3, local_cache)


def _shard_sizes(local_cache: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (local_cache / "shards").iterdir()}


def _kept(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in directory.iterdir()}


def test_keeps_what_fits_and_reads_the_rest_by_ranges(remote: str, local_cache: Path, tmp_path: Path) -> None:
    sizes = _shard_sizes(local_cache)
    bound = sum(sorted(sizes.values())[-2:])  # two shards at least
    with Cache.open(local_cache) as plain:
        expected = {e.row: plain.read(e.row).input_ids for e in plain.entries()}
    # One reader open at a time: every shard is opened again at each of its rows, as shards are at scale
    with Cache.open(remote, local_dir=tmp_path / "l", shard_cache_bytes=bound, max_open_shards=1) as cache:
        kept_files = cache._shard_cache
        downloads = []
        for rows in (sorted(expected), sorted(expected, reverse=True)):  # two epochs, another order
            for row in rows:
                assert cache.read(row).input_ids.equal(expected[row])
            downloads.append(kept_files.misses)
        kept = _kept(tmp_path / "l" / "shards")
        assert 2 <= len(kept) < len(sizes) and sum(kept.values()) <= bound
        # Each kept shard was downloaded once, in the first epoch; the others never whole, however often opened.
        assert downloads == [len(kept), len(kept)] and kept_files.remote >= 2 * (len(sizes) - len(kept))
        assert cache.read_fanout > 1  # some reads wait on the network


def test_threads_opening_one_shard_download_it_once(remote: str, local_cache: Path, tmp_path: Path) -> None:
    storage = open_storage(remote)
    name, size = sorted(_shard_sizes(local_cache).items())[0]
    kept = ShardFileCache(tmp_path / "shards", 10 * size)
    start = threading.Barrier(8)

    def open_it(_: int) -> object:
        start.wait()
        return kept.open(storage, f"shards/{name}", name, size)

    with ThreadPoolExecutor(8) as pool:
        files = list(pool.map(open_it, range(8)))
    assert all(isinstance(f, LocalFile) for f in files)
    assert (kept.misses, kept.hits) == (1, 7)
    assert _kept(tmp_path / "shards") == {name: size}  # no temp file or reservation left


def _dead_pid() -> int:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(gone.stdout)


def _age(path: Path, seconds: float) -> Path:
    old = time.time() - seconds
    os.utime(path, (old, old))
    return path


def test_other_processes_reservations_count_and_stale_ones_go(
    remote: str, local_cache: Path, tmp_path: Path
) -> None:
    storage = open_storage(remote)
    name, size = sorted(_shard_sizes(local_cache).items())[0]
    directory = tmp_path / "shards"
    directory.mkdir()
    other_host = "0badc0de"  # the directory on a filesystem other nodes share: their pids mean nothing here
    in_flight = [
        reservation_name(f"{os.getppid()}-{host_tag()}", size, "shard-999999.dfs"),  # this host, alive
        reservation_name(f"{_dead_pid()}-{other_host}", size, "shard-999998.dfs"),  # another host's, recent
    ]
    for live in in_flight:
        (directory / live).touch()
        kept = ShardFileCache(directory, size + size // 2)
        assert isinstance(kept.open(storage, f"shards/{name}", name, size), RemoteFile), live
        (directory / live).unlink()
    dead = _dead_pid()
    (directory / reservation_name(f"{dead}-{host_tag()}", size, "shard-999999.dfs")).touch()  # process killed
    abandoned = directory / reservation_name(f"{dead}-{other_host}", size, "shard-999998.dfs")
    abandoned.touch()
    _age(abandoned, FOREIGN_STALE_S + 60)  # another host's, untouched for over an hour
    (directory / f".{name}.tmp-{dead}-{host_tag()}-7").write_bytes(b"partial")
    # a full directory is counted again only RECHECK_SECONDS later: another process (or a later run) now
    again = ShardFileCache(directory, size + size // 2)
    assert isinstance(kept.open(storage, f"shards/{name}", name, size), RemoteFile)
    assert isinstance(again.open(storage, f"shards/{name}", name, size), LocalFile)
    assert _kept(directory) == {name: size}


def test_files_in_flight_are_named_by_host_and_abandoned_ones_told_apart(tmp_path: Path) -> None:
    """A shared home directory (NFS) holds other nodes' downloads: a pid names a process of its own host only,
    so another host's file counts as abandoned by its age, and two hosts' processes of one pid never write one
    temp file."""
    temp = temp_path(tmp_path / "shard-000001.dfs")
    assert temp.name == f".shard-000001.dfs.tmp-{os.getpid()}-{host_tag()}-{threading.get_native_id()}"
    dead, alive = _dead_pid(), os.getppid()
    cases = {
        f".a.tmp-{dead}-{host_tag()}-5": True,
        f".b.tmp-{alive}-{host_tag()}-5": False,
        f".c.tmp-{dead}-0badc0de-5": False,  # another host's, written a moment ago
        f".d.tmp-{dead}": True,  # before host tags (the extraction writer's name still)
        f".e.tmp-{dead}-5": True,
        f".f.tmp-{alive}-5": False,
        ".g.tmp-x": False,  # not a temp name of ours
        f"h.tmp-{dead}": False,
    }
    for name, gone in cases.items():
        (tmp_path / name).touch()
        assert left_by_dead_process(tmp_path / name) is gone, name
    assert left_by_dead_process(_age(tmp_path / f".c.tmp-{dead}-0badc0de-5", FOREIGN_STALE_S + 60))


def test_a_smaller_bound_keeps_the_most_recently_used(remote: str, local_cache: Path, tmp_path: Path) -> None:
    storage = open_storage(remote)
    sizes = sorted(_shard_sizes(local_cache).items())[:3]
    directory = tmp_path / "shards"
    big = ShardFileCache(directory, 10 * sum(s for _, s in sizes))
    for name, size in sizes:
        big.open(storage, f"shards/{name}", name, size).close()
    for when, (name, _) in enumerate(reversed(sizes)):  # the first shard is the most recently used
        os.utime(directory / name, (1_000_000 + when, 1_000_000 + when))
    ShardFileCache(directory, sizes[0][1] + 1)
    assert _kept(directory) == {sizes[0][0]: sizes[0][1]}


_READ_ALL = """
import sys
from dflash.shards import Cache
with Cache.open(sys.argv[1], local_dir=sys.argv[2], shard_cache_bytes=int(sys.argv[3]), max_open_shards=1) as c:
    for _ in range(2):
        for e in c.entries():
            c.read(e.row)
"""


def test_processes_sharing_the_directory_keep_the_bound(
    remote: str, local_cache: Path, tmp_path: Path
) -> None:
    sizes = _shard_sizes(local_cache)
    bound = sum(sorted(sizes.values())[:3]) + 1
    procs = [
        subprocess.Popen([sys.executable, "-c", _READ_ALL, remote, str(tmp_path / "l"), str(bound)])
        for _ in range(3)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    kept = _kept(tmp_path / "l" / "shards")
    assert kept and sum(kept.values()) <= bound
    assert all(not name.startswith(".") for name in kept)


def test_caches_keep_readers_open_for_an_epochs_shuffle_window() -> None:
    """The spans order's shuffle window holds samples of ~100 shards: with too few readers open, every shard is
    opened again many times an epoch (64 readers: 14 times on 200 shards of 475 rows)."""
    assert opens_per_shard(475, 200, 64, "spans", 1024) > 10  # the measure tells the two apart
    assert opens_per_shard(475, 200, MAX_OPEN_SHARDS, "spans", 1024) < 1.1


def test_readers_kept_open_leave_most_descriptors_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))
    assert default_open_shards() == MAX_OPEN_SHARDS == 256
    monkeypatch.setattr(resource, "getrlimit", lambda _: (256, 4096))
    assert default_open_shards() == 64


def test_a_reader_killed_at_any_moment_leaves_only_whole_shards(
    remote: str, local_cache: Path, tmp_path: Path
) -> None:
    sizes = _shard_sizes(local_cache)
    bound = sum(sorted(sizes.values())[:3]) + 1
    argv = [sys.executable, "-c", _READ_ALL, remote, str(tmp_path / "l"), str(bound)]
    for delay in (0.3, 0.6, 0.9, 1.2, 1.5):  # start-up, staging, downloads, range reads
        proc = subprocess.Popen(argv)
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # A later reader removes what the killed ones left (temp files, reservations) and keeps the bound.
    assert subprocess.run(argv, timeout=120).returncode == 0
    kept = _kept(tmp_path / "l" / "shards")
    assert kept and sum(kept.values()) <= bound
    assert all(sizes[name] == size for name, size in kept.items())  # only whole shards, under their names
