"""Hostile and damaged caches (issue 16): every case is one line and exit 2 (or a `verify` failure naming
it), in bounded time and memory; a fuzz test over manifest, index and footer bytes finds no traceback."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from common.fake_cache import write_fake_cache
from common.hostile import (
    add_shard,
    bomb_sample,
    cli,
    copy_shard,
    one_error_line,
    repeat_row,
    resign_manifest,
    rewrite_index,
    run_measured,
    tree_snapshot,
)
from dflash.shards import Cache, ShardError, encode_sample, get_codec, verify_cache
from dflash.shards.errors import DuplicateRows
from dflash.shards.layout import FOOTER
from dflash.tools.shards_cli import main as shards_main
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SHARDS = "dflash.tools.shards_cli"
PROG = "dflash-shards"
# A Python process that imported torch and read a tiny cache peaks near 300-400 MB here; decoding the
# 4M-token bomb below would need > 1.5 GB (`show` works in float64).
RSS_BOUND_MB = 900
BOMB_TOKENS = 1 << 22


def _cache(root: Path) -> Path:
    return write_fake_cache(root, num_samples=12, samples_per_shard=4, layers=(0, 1), min_len=8, max_len=24)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _cache(tmp_path_factory.mktemp("template") / "cache")


@pytest.fixture
def cache(template: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(template, tmp_path / "cache"))


def _shard(cache: Path, unit: int = 0) -> Path:
    return cache / "shards" / f"shard-{unit:06d}.dfs"


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert shards_main(list(argv)) == 2
    return one_error_line(capsys.readouterr().err, PROG)


def _verify_problems(cache: Path) -> list[str]:
    with Cache.open(cache) as c:
        report = verify_cache(c)
    assert not report.ok
    return report.lines()


# --- item 2: decompression bombs inside the size bound ----------------------------------------------


def test_bomb_refused_before_decoding_in_bounded_memory(cache: Path) -> None:
    add_shard(cache, 3, [bomb_sample(cache, row=12, tokens=BOMB_TOKENS)])
    rc, err, rss = run_measured(cli(SHARDS, "show", str(cache), "12"))
    message = f"length {BOMB_TOKENS} exceeds the 24 tokens the cache declares"
    assert rc == 2 and message in one_error_line(err, PROG)
    assert rss < RSS_BOUND_MB, f"peak RSS {rss} MB"
    tracemalloc.start()  # verify in this process: numpy arrays and zstd output are traced allocations
    try:
        problems = _verify_problems(cache)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert any(message in p for p in problems) and peak < 64 << 20, (peak, problems)


# --- item 5: verify decodes every frame ---------------------------------------------------------------


def _length_off_by_one(cache: Path) -> None:
    rewrite_index(
        _shard(cache), lambda ix: ix["samples"][1].__setitem__("length", ix["samples"][1]["length"] - 1)
    )


def _supervised_zero(cache: Path) -> None:
    rewrite_index(_shard(cache), lambda ix: ix["samples"][2].__setitem__("supervised", 0))


def _ids_outside_vocab(cache: Path) -> None:
    codec = get_codec("lossless")
    layers = [torch.zeros(5, 32, dtype=torch.bfloat16)] * 2
    add_shard(cache, 3, [encode_sample(codec, 12, np.array([5, 6, 400, 7, 8]), np.ones(5), layers)])


def _nonfinite_states(cache: Path) -> None:
    shutil.rmtree(cache)
    write_fake_cache(
        cache, num_samples=12, samples_per_shard=4, layers=(0, 1), min_len=8, max_len=24, nonfinite_rows=(5,)
    )


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (_length_off_by_one, "does not match the frame"),
        (_supervised_zero, "supervised tokens, the index says 0"),
        (_ids_outside_vocab, "1 token ids outside the target's vocabulary 0..95"),
        (_nonfinite_states, "row 5) frame layer 0 at"),
    ],
)
def test_verify_decodes_every_frame(cache: Path, damage, problem: str) -> None:
    damage(cache)
    resign_manifest(cache)  # the manifest agrees with the shards: only the planted damage is left
    with Cache.open(cache) as c:  # hashes alone (the old `verify`, now --quick) cannot see it
        assert not any(c.shard(name).verify() for name in c.shard_names)
    problems = _verify_problems(cache)
    assert any(problem in p for p in problems), problems
    assert shards_main(["verify", str(cache), "--quick"]) == 0 and shards_main(["verify", str(cache)]) == 1
    if damage is _nonfinite_states:
        assert any("2 non-finite (NaN/inf) values" in p for p in problems), problems


# --- item 6: manifests a reader must not accept -----------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["shards"].append(d["shards"][0]), "shard shard-000000.dfs is listed twice"),
        (lambda d: d.__setitem__("codec", {"name": "zip"}), "codec: unknown codec 'zip'"),
        (lambda d: d.__setitem__("dtype", "int8"), "dtype 'int8' is not one of"),
        (lambda d: d.__setitem__("layers", [0, 1, 1]), "'layers' lists a layer twice"),
        (lambda d: d.__setitem__("version", True), "format version True is not supported"),
        # Present but not counts: each would lift a limit readers enforce, or describe another cache.
        (lambda d: d["target"].__setitem__("vocab_size", -1), "target.vocab_size is -1, not an integer >= 1"),
        (lambda d: d["options"].__setitem__("max_len", "40"), "options.max_len is '40', not an integer >= 1"),
        (lambda d: d["options"].__setitem__("max_len", 0), "options.max_len is 0, not an integer >= 1"),
        (lambda d: d["target"].__setitem__("num_hidden_layers", -4), "target.num_hidden_layers is -4"),
        (lambda d: d["dataset"].__setitem__("rows", "x"), "dataset.rows is 'x', not an integer >= 0"),
        (lambda d: d["target"].__setitem__("hidden_size", 64), "target.hidden_size 64 != hidden_size 32"),
        # Names of target/ files are opened under target/: a path in one would read outside the cache.
        (
            lambda d: d.__setitem__("target_files", {"/etc/passwd": {"bytes": 1}}),
            "target_files name '/etc/passwd' is not a plain file name",
        ),
    ],
)
def test_loose_manifests_refused_in_one_line(cache: Path, capsys, edit, message: str) -> None:
    resign_manifest(cache, edit)
    assert message in _refused(capsys, "info", str(cache))


# --- a row stored twice: readers that plan over the cache refuse it, verify lists it --------------------------


@pytest.mark.parametrize(
    ("damage", "message", "listed"),
    [
        (  # a shard copied under a second name and listed: refused as the cache opens (the manifest betrays it)
            lambda c: copy_shard(c, 1, 3),
            "row 4 is stored in both shard-000001.dfs and shard-000003.dfs (4 rows of shard-000003.dfs are stored "
            "twice: 4, 5, 6, 7)",
            "row 4 stored 2 times (in shard-000001.dfs, shard-000003.dfs)",
        ),
        (  # the manifest's counts add up: refused when the second shard's index is read
            lambda c: repeat_row(c, 2, 0, 5),
            "row 5 is stored in both shard-000001.dfs and shard-000002.dfs: a reader would use it twice",
            "row 5 stored 2 times (in shard-000001.dfs, shard-000002.dfs)",
        ),
        (
            lambda c: repeat_row(c, 0, 1, 0),
            "row 0 is stored twice in shard-000000.dfs: a reader would use it twice",
            "row 0 stored 2 times (in shard-000000.dfs)",
        ),
    ],
)
def test_row_stored_twice_is_refused_by_readers_and_listed_by_verify(
    cache: Path, capsys, damage, message: str, listed: str
) -> None:
    damage(cache)
    with pytest.raises(DuplicateRows) as refused, Cache.open(cache) as c:
        c.entries()
    assert message in str(refused.value) and f"dflash-shards verify {cache}" in str(refused.value)
    assert "\n" not in str(refused.value)
    assert shards_main(["verify", str(cache)]) == 1  # the inspecting commands read it and say what is wrong
    assert f"  {listed}" in capsys.readouterr().out.splitlines()
    assert shards_main(["ls", str(cache)]) == 0 and shards_main(["info", str(cache)]) == 0


# --- item 7: tracebacks and hangs ------------------------------------------------------------------------


def test_deeply_nested_manifest_and_index(cache: Path, capsys) -> None:
    deep = b"[" * 200_000 + b"]" * 200_000
    index_copy = cache.parent / "index_case"
    shutil.copytree(cache, index_copy)
    (cache / "manifest.json").write_bytes(b'{"format": "dflash-cache", "version": 1, "x": ' + deep + b"}")
    assert "nested 200001 levels deep" in _refused(capsys, "info", str(cache))
    rewrite_index(_shard(index_copy), lambda ix: None, lambda raw: raw[:-1] + b', "x": ' + deep + b"}")
    assert "index: JSON nested 200001 levels deep" in _refused(capsys, "show", str(index_copy), "0")


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_shard_that_is_not_a_file(cache: Path, capsys, kind: str) -> None:
    path = _shard(cache, 1)
    path.unlink()
    os.mkdir(path) if kind == "directory" else os.mkfifo(path)
    what = "a directory" if kind == "directory" else "a FIFO"
    results: list[int] = []
    for argv in (["show", str(cache), "5"], ["verify", str(cache)]):
        # A FIFO used to block both forever: run each in a thread and give up on it after 30 s.
        t = threading.Thread(target=lambda a=argv: results.append(shards_main(a)), daemon=True)
        t.start()
        t.join(timeout=30)
        assert not t.is_alive(), f"{argv[0]} hangs on a shard that is {what}"
    out, err = capsys.readouterr()
    assert results == [2, 1]
    assert f"shard {path} is {what}" in one_error_line(err, PROG)
    assert f"shard {path} is {what}, not a regular file" in out


def test_convert_follows_the_out_rule(cache: Path, tmp_path: Path, capsys) -> None:
    """`dflash-shards convert --out` is held to extraction's rule: a foreign directory (dotfiles count) and a
    directory inside the source cache are refused untouched, and a link planted at a marked directory's
    lock is refused, not followed."""
    foreign = tmp_path / "foreign"
    (foreign / "shards").mkdir(parents=True)
    (foreign / ".git").write_text("user's")
    (foreign / "shards" / ".shard-000000.dfs.tmp-1").write_text("user's")
    before = tree_snapshot(foreign)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    marked = tmp_path / "marked"
    marked.mkdir()
    (marked / ".dflash").write_text('{"kind": "cache"}')
    os.symlink(victim, marked / ".lock")
    for out, problem in (
        (foreign, "was not written by dflash"),
        (cache / "converted", f"is inside the dflash cache {cache}"),
        (marked, "is a symbolic link"),
    ):
        assert problem in _refused(capsys, "convert", str(cache), "--codec", "fp8", "--out", str(out))
    assert tree_snapshot(foreign) == before and not (cache / "converted").exists()
    assert victim.read_text() == "keep" and os.path.islink(marked / ".lock")


# --- fuzz: manifest, index and footer bytes ------------------------------------------------------------------

_ALLOWED = (ShardError, ValueError, FileNotFoundError)  # what run_main turns into one line and exit 2


def _exercise(cache: Path) -> None:
    """What the CLIs and the loader do with a cache; only one-line errors may come out."""
    try:
        with Cache.open(cache, require_complete=False) as c:
            for e in c.entries():
                c.shard(e.shard).read(e.index)
                c.shard(e.shard).read(e.index, [1], max_tokens=5)  # the loader's read: a prefix of one layer
            verify_cache(c, dataset_rows=12)
    except _ALLOWED:
        pass


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    part=st.sampled_from(["manifest", "index", "footer"]),
    edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=6),
    cut=st.one_of(st.none(), st.floats(0, 1)),
)
def test_fuzzed_manifest_index_footer_bytes_never_traceback(
    template: Path, part: str, edits: list[tuple[float, int]], cut: float | None
) -> None:
    with tempfile.TemporaryDirectory() as d:
        cache = Path(shutil.copytree(template, Path(d) / "c"))
        path = cache / "manifest.json" if part == "manifest" else _shard(cache)
        data = bytearray(path.read_bytes())
        if part == "manifest":
            lo, hi = 0, len(data)
        else:
            off, length, _, _ = FOOTER.unpack(data[-FOOTER.size :])
            lo, hi = (off, off + length) if part == "index" else (len(data) - FOOTER.size, len(data))
        for where, value in edits:
            data[lo + int(where * (hi - lo))] = value
        if cut is not None:
            del data[lo + int(cut * (hi - lo)) :]
        path.write_bytes(bytes(data))
        _exercise(cache)


def test_fuzz_baseline_cache_is_sound(template: Path) -> None:
    with Cache.open(template) as c:
        assert verify_cache(c, dataset_rows=12).ok
    assert json.loads((template / "manifest.json").read_text())["options"]["max_len"] == 24
