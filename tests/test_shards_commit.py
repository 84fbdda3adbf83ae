"""The Committer: shards publish in the background while the next one streams, bounded, failures surface."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from dflash.shards import DiskFull, ShardMeta, ShardReader, ShardWriter, encode_sample, get_codec, shard_name
from dflash.shards.writer import Committer, stale_temp_files

CODEC = get_codec("lossless")
META = ShardMeta(codec=CODEC, layers=[0], hidden_size=32)


def _finished(root: Path, unit: int, rows: int = 3) -> ShardWriter:
    w = ShardWriter(root / shard_name(unit), META)
    for r in range(rows):
        x = torch.randn(7, 32).bfloat16()
        w.append(encode_sample(CODEC, unit * 100 + r, torch.arange(7), torch.ones(7), [x]))
    w.finish()
    return w


class _GatedFsync:
    """os.fsync that blocks on shard files until released (the disk is slow)."""

    def __init__(self, real):
        self.real, self.entered, self.gate = real, threading.Event(), threading.Event()

    def __call__(self, fd: int) -> None:
        if "shard-" in os.readlink(f"/proc/self/fd/{fd}"):
            self.entered.set()
            assert self.gate.wait(30), "the fsync was never released"
        self.real(fd)


def test_next_shard_streams_while_the_last_one_is_flushed(tmp_path: Path, monkeypatch) -> None:
    fsync = _GatedFsync(os.fsync)
    monkeypatch.setattr(os, "fsync", fsync)
    with Committer(depth=2) as committer:
        committer.submit(_finished(tmp_path, 0))  # returns while shard 0 waits for the disk
        assert fsync.entered.wait(10)
        committer.submit(_finished(tmp_path, 1))  # streamed meanwhile
        time.sleep(0.1)
        assert not any(tmp_path.glob("shard-*.dfs"))  # nothing visible before its fsync
        fsync.gate.set()
        committer.drain()
    for unit in (0, 1):
        with ShardReader.open(tmp_path / shard_name(unit)) as r:
            assert r.verify() == [] and len(r) == 3
    assert stale_temp_files(tmp_path) == []


def test_submit_waits_while_every_commit_slot_is_busy(tmp_path: Path, monkeypatch) -> None:
    """depth=1: the writer may not run more than one shard ahead of the disk."""
    fsync = _GatedFsync(os.fsync)
    monkeypatch.setattr(os, "fsync", fsync)
    with Committer(depth=1) as committer:
        committer.submit(_finished(tmp_path, 0))
        blocked = threading.Thread(target=committer.submit, args=(_finished(tmp_path, 1),))
        blocked.start()
        blocked.join(0.3)
        assert blocked.is_alive()
        fsync.gate.set()
        blocked.join(10)
        assert not blocked.is_alive()
        committer.drain()
    assert sorted(p.name for p in tmp_path.glob("shard-*.dfs")) == [shard_name(0), shard_name(1)]


def test_a_failed_publish_is_raised_and_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    real = os.fsync

    def full(fd: int) -> None:
        if "shard-000001" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    monkeypatch.setattr(os, "fsync", full)
    with Committer(depth=2) as committer:
        committer.submit(_finished(tmp_path, 0))
        committer.submit(_finished(tmp_path, 1))
        with pytest.raises(DiskFull, match="shard-000001"):
            committer.drain()
    assert [p.name for p in tmp_path.iterdir()] == [shard_name(0)]  # shard 1's temp file removed
    with pytest.raises(ValueError, match="depth"):
        Committer(depth=0)


def test_small_frames_are_gathered_into_few_writes(tmp_path: Path, monkeypatch) -> None:
    """Hundreds of tiny frames reach the disk in a handful of writes; the bytes are the same as ever."""
    w = ShardWriter(tmp_path / shard_name(0), META)
    sizes: list[int] = []
    real = w._file.write
    monkeypatch.setattr(
        w,
        "_file",
        type(
            "F",
            (),
            {
                "write": lambda self, b: sizes.append(len(b)) or real(b),
                "fileno": w._file.fileno,
                "close": w._file.close,
                "closed": property(lambda self: w._file.closed),
            },
        )(),
    )
    for r in range(200):
        w.append(encode_sample(CODEC, r, [1, 2], [0, 1], [torch.randn(2, 32).bfloat16()]))
    info = w.commit()
    assert len(sizes) <= 3 and sum(sizes) == info.bytes == (tmp_path / shard_name(0)).stat().st_size
    with ShardReader.open(tmp_path / shard_name(0)) as r:
        assert r.verify() == [] and len(r) == 200
