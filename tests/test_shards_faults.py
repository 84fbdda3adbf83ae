"""Corruption, hostile indexes, killed writers and full disks: never garbage, never a partial shard."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from common.hostile import rewrite_index
from common.synth import make_cache
from dflash.shards import (
    Cache,
    CorruptFrame,
    DiskFull,
    ShardError,
    ShardMeta,
    ShardReader,
    ShardWriter,
    encode_sample,
    get_codec,
    shard_name,
    verify_cache,
)
from dflash.shards.layout import FOOTER, FOOTER_MAGIC
from dflash.shards.writer import stale_temp_files

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cache")
    make_cache(path, [6, 40, 1, 17, 9], layers=(0, 2), hidden=24, rows_per_shard=3)
    return path


def _verify(path: Path) -> tuple[bool, dict[str, list[str]], list[str]]:
    with Cache.open(path) as cache:
        report = verify_cache(cache, dataset_rows=5)
    return report.ok, report.bad_shards, report.problems


def test_every_single_byte_flip_is_caught_and_names_the_shard(cache_dir: Path) -> None:
    assert _verify(cache_dir)[0]
    target = cache_dir / "shards" / shard_name(0)
    original = target.read_bytes()
    positions = random.Random(0).sample(range(len(original)), 60)
    positions += [0, 7, 8, len(original) - 1, len(original) - 32, len(original) - 20]  # magic, data, footer
    try:
        for pos in positions:
            corrupt = bytearray(original)
            corrupt[pos] ^= 1 << (pos % 8)
            target.write_bytes(bytes(corrupt))
            ok, bad, _ = _verify(cache_dir)
            assert not ok, f"flip at byte {pos} went unnoticed"
            assert list(bad) == [shard_name(0)], f"flip at byte {pos}: {bad}"
            assert all(str(target) in line for line in bad[shard_name(0)])
    finally:
        target.write_bytes(original)
    assert _verify(cache_dir)[0]


def test_truncation_is_caught(cache_dir: Path) -> None:
    target = cache_dir / "shards" / shard_name(1)
    original = target.read_bytes()
    try:
        for size in (0, 7, 8, 100, len(original) // 2, len(original) - 33, len(original) - 1):
            target.write_bytes(original[:size])
            ok, bad, _ = _verify(cache_dir)
            assert not ok and list(bad) == [shard_name(1)], size
    finally:
        target.write_bytes(original)


def test_reading_a_corrupt_frame_raises_naming_file_row_and_frame(tmp_path: Path) -> None:
    make_cache(tmp_path, [30, 30], layers=(4,), hidden=16, rows_per_shard=2)
    path = tmp_path / "shards" / shard_name(0)
    with ShardReader.open(path) as r:
        off, length, _ = r.entries[1].frames[2]
    data = bytearray(path.read_bytes())
    data[off + length // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with Cache.open(tmp_path) as cache:
        assert cache.read(0).length == 30  # other samples stay readable
        assert cache.read(1, layers=[]).length == 30  # and the same sample without the bad layer
        with pytest.raises(CorruptFrame, match=rf"{path}: sample 1 \(row 1\) frame layer 4 .*checksum"):
            cache.read(1)


def _set_frame(i: int, k: int, field: int, value: object):
    def edit(index: dict) -> None:
        index["samples"][i]["frames"][k][field] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set_frame(0, 0, 1, 2**64 + 5), "must be an integer"),
        (_set_frame(0, 1, 0, 3), "overlaps the previous frame"),
        (_set_frame(1, 0, 0, 10**6), "hole"),
        (_set_frame(2, 3, 1, 10**9), "runs past the data region"),
        (_set_frame(0, 0, 1, 1.5), "must be an integer"),
        (lambda ix: ix["samples"][0]["frames"].pop(), "expected 4 frames"),
        (lambda ix: ix["samples"][0].__setitem__("length", 10**9), "cannot decode to"),
        (lambda ix: ix["samples"][0].__setitem__("supervised", 100), "supervised"),
        (lambda ix: ix.__setitem__("version", 99), "version 99 not supported"),
        (lambda ix: ix.__setitem__("codec", {"name": "pickle"}), "unknown codec"),
        (lambda ix: ix.__setitem__("dtype", "float64"), "dtype"),
        (lambda ix: ix.__setitem__("hidden_size", 2**40), "hidden_size"),
        (lambda ix: ix["samples"].pop(), "unindexed bytes"),
    ],
)
def test_hostile_indexes_are_refused_at_open(tmp_path: Path, edit, message: str) -> None:
    make_cache(tmp_path, [6, 40, 1], layers=(0, 2), hidden=24, rows_per_shard=3)
    path = tmp_path / "shards" / shard_name(0)
    rewrite_index(path, edit)
    with pytest.raises(ShardError, match=message) as info:
        ShardReader.open(path)
    assert str(path) in str(info.value)


def test_hostile_footer_cannot_claim_more_than_the_file(tmp_path: Path) -> None:
    make_cache(tmp_path, [6], hidden=8)
    path = tmp_path / "shards" / shard_name(0)
    data = path.read_bytes()
    for off, length in [(2**64 - 1, 2), (8, 2**64 - 1), (2**63, 2**63), (8, len(data))]:
        path.write_bytes(data[:-32] + FOOTER.pack(off, length, 0, FOOTER_MAGIC))
        with pytest.raises(ShardError, match="footer places the index"):
            ShardReader.open(path)


_KILLED_WRITER = textwrap.dedent(
    """
    import sys, time, torch
    sys.path.insert(0, {tests!r})
    from common.synth import llm_like_layers
    from dflash.shards import ShardMeta, ShardWriter, encode_sample, get_codec
    codec = get_codec("lossless")
    w = ShardWriter({path!r}, ShardMeta(codec=codec, layers=[0], hidden_size=64))
    for row in range(10_000):
        w.append(encode_sample(codec, row, torch.arange(50), torch.ones(50), llm_like_layers(50, 64, 1, seed=row)))
        if row == 300:  # small frames reach the disk in ~1 MiB writes: 300 rows are ~1.8 MB
            print("appending", flush=True)
        time.sleep(0.001)
    """
)


def test_sigkilled_writer_leaves_no_committed_shard(tmp_path: Path) -> None:
    make_cache(tmp_path, [5, 6], rows_per_shard=2, complete=False)
    path = tmp_path / "shards" / shard_name(1)
    code = _KILLED_WRITER.format(tests=str(TESTS), path=str(path))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "appending"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not path.exists()
    stale = stale_temp_files(tmp_path / "shards")
    assert [p.name for p in stale] == [f".{path.name}.tmp-{proc.pid}"] and stale[0].stat().st_size > 8
    with Cache.open(tmp_path, require_complete=False) as cache:
        assert cache.shard_names == [shard_name(0)] and [e.row for e in cache.entries()] == [0, 1]


class _FullDisk:
    """A raw file whose writes fail with ENOSPC once `room` bytes are down (like a full filesystem)."""

    def __init__(self, real, room: int):
        self.real, self.room = real, room

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.real.write(data)

    def __getattr__(self, name: str):
        return getattr(self.real, name)


@pytest.mark.parametrize("room", [100, 3000, 20_000])
def test_disk_full_aborts_cleanly(tmp_path: Path, room: int) -> None:
    codec = get_codec("lossless")
    path = tmp_path / "shards" / shard_name(0)
    w = ShardWriter(path, ShardMeta(codec=codec, layers=[0], hidden_size=64))
    w._file = _FullDisk(w._file, room)
    with pytest.raises(DiskFull, match="no space left") as info, w:
        for row in range(100):
            x = torch.randn(20, 64).bfloat16()
            w.append(encode_sample(codec, row, torch.arange(20), torch.ones(20), [x]))
        w.commit()
    assert str(path) in str(info.value)
    assert list((tmp_path / "shards").iterdir()) == []  # temp file gone, nothing committed
    with pytest.raises(ShardError, match="after commit/abort"):
        w.append(encode_sample(codec, 0, [1], [1], [torch.zeros(1, 64, dtype=torch.bfloat16)]))


def test_exception_inside_with_block_discards_the_shard(tmp_path: Path) -> None:
    codec = get_codec("fp8")
    path = tmp_path / shard_name(3)
    with (
        pytest.raises(RuntimeError),
        ShardWriter(path, ShardMeta(codec=codec, layers=[1], hidden_size=4)) as w,
    ):
        w.append(encode_sample(codec, 0, [1, 2], [0, 1], [torch.ones(2, 4)]))
        raise RuntimeError("extractor crashed")
    assert list(tmp_path.iterdir()) == []
    with ShardWriter(path, ShardMeta(codec=codec, layers=[1], hidden_size=4)) as w:
        pass  # leaving without commit() commits nothing
    assert list(tmp_path.iterdir()) == []
