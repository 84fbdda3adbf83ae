"""`dflash-shards convert`: decode-then-encode exactly, resumable after SIGKILL, refuses other settings, verifies."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from common.fake_cache import TINY_TARGET, write_fake_cache
from common.hostile import copy_shard, one_error_line, repeat_row, resign_manifest
from common.synth import make_cache
from dflash.shards import Cache, ManifestMismatch, ShardError, get_codec, load_manifest, verify_cache
from dflash.shards.convert import ConvertConfig, convert_cache, sample_groups
from dflash.tools.shards_cli import main as shards_main
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

TESTS = Path(__file__).resolve().parent
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _source(
    path: Path, rows: int, codec: str = "lossless", *, per_shard: int = 3, hidden: int = 32, **kw
) -> Path:
    """A complete cache with its target/ parts, rows of 1..40 tokens."""
    target = {**TINY_TARGET, "hidden_size": hidden}
    kw.setdefault("min_len", 1)
    return write_fake_cache(
        path, num_samples=rows, samples_per_shard=per_shard, codec=codec, target=target, **kw
    )


def _shard_bytes(cache: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((cache / "shards").iterdir())}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.integers(1, 9),
    pair=st.sampled_from([("lossless", "fp8"), ("lossless", "q4"), ("fp8", "q6"), ("q4", "lossless")]),
    per_shard=st.integers(1, 4),
    hidden=st.sampled_from([8, 33, 64]),
    seed=st.integers(0, 1000),
)
def test_convert_is_decode_then_encode_and_verifies(
    tmp_path_factory: pytest.TempPathFactory,
    rows: int,
    pair: tuple[str, str],
    per_shard: int,
    hidden: int,
    seed: int,
) -> None:
    root = tmp_path_factory.mktemp("convert")
    src_codec, dst_codec = pair
    src = _source(root / "src", rows, src_codec, per_shard=per_shard, hidden=hidden, layers=(0, 2), seed=seed)
    result = convert_cache(ConvertConfig(source=src, out=root / "dst", codec=dst_codec, threads=2))
    assert result.converted == result.shards == len(load_manifest(src).shards) and result.rows == rows
    codec = get_codec(dst_codec)
    with Cache.open(src) as a, Cache.open(root / "dst") as b:
        assert verify_cache(b, dataset_rows=rows).ok
        assert b.shard_names == a.shard_names and [e.row for e in b.entries()] == [e.row for e in a.entries()]
        for e in a.entries():
            x, y = a.read(e.row), b.read(e.row)
            assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
            for layer in (0, 2):
                want = codec.decode(codec.encode(x.hidden[layer]), tuple(x.hidden[layer].shape), "bfloat16")
                assert torch.equal(y.hidden[layer].view(torch.int16), want.view(torch.int16))
        old, new = a.manifest.to_dict(), b.manifest.to_dict()
        assert new["codec"] == codec.to_dict() and new["dtype"] == "bfloat16"
        assert new["options"]["converted_from"][-1]["codec"] == old["codec"]
        for key in ("target", "layers", "hidden_size", "dataset", "plan", "skipped"):
            assert new[key] == old[key], key
    for part in ("config.json", "frozen.safetensors", "tokenizer.json"):
        assert (root / "dst" / "target" / part).read_bytes() == (src / "target" / part).read_bytes()
    # a re-run finds everything committed and does nothing
    again = convert_cache(ConvertConfig(source=src, out=root / "dst", codec=dst_codec))
    assert again.converted == 0 and again.shards == result.shards


_KILLED = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from dflash.shards import convert
    encode = convert._encode_group
    def slow(*args):
        time.sleep(0.02)
        return encode(*args)
    convert._encode_group = slow
    convert.convert_cache(convert.ConvertConfig(source={src!r}, out={out!r}, codec="q4", threads=1))
    """
)


def test_resume_after_sigkill_equals_an_uninterrupted_conversion(tmp_path: Path) -> None:
    src = _source(tmp_path / "src", 24, min_len=20, max_len=40)
    reference = convert_cache(ConvertConfig(source=src, out=tmp_path / "reference", codec="q4"))
    out = tmp_path / "killed"
    code = _KILLED.format(tests=str(TESTS), src=str(src), out=str(out))
    for goal in (2, 5):  # kill mid-shard, after a few shards were committed
        proc = subprocess.Popen([sys.executable, "-c", code])
        try:
            deadline = time.monotonic() + 120
            while len(list(out.glob("shards/shard-*.dfs"))) < goal and proc.poll() is None:
                assert time.monotonic() < deadline
                time.sleep(0.005)
            time.sleep(0.03)
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        assert not load_manifest(out).complete
        assert 0 < len(list(out.glob("shards/shard-*.dfs"))) < reference.shards
    # a committed shard torn afterwards (a disk error) is redone, not trusted
    torn = sorted(out.glob("shards/shard-*.dfs"))[0]
    torn.write_bytes(torn.read_bytes()[:-5])
    result = convert_cache(ConvertConfig(source=src, out=out, codec="q4"))
    assert 0 < result.converted < reference.shards
    assert _shard_bytes(out) == _shard_bytes(tmp_path / "reference")
    assert not [p for p in (out / "shards").iterdir() if p.name.startswith(".")]
    assert load_manifest(out).to_dict() | {"tool_version": ""} == load_manifest(
        tmp_path / "reference"
    ).to_dict() | {"tool_version": ""}
    with Cache.open(out) as cache:
        assert verify_cache(cache, dataset_rows=24).ok


def test_other_settings_or_source_are_refused_naming_the_field(tmp_path: Path) -> None:
    src = _source(tmp_path / "src", 3, per_shard=2)
    out = tmp_path / "out"
    convert_cache(ConvertConfig(source=src, out=out, codec="fp8"))
    with pytest.raises(ManifestMismatch, match=r"codec.name: 'fp8' != 'q4'"):
        convert_cache(ConvertConfig(source=src, out=out, codec="q4"))
    other = _source(tmp_path / "other", 3, per_shard=2, seed=1)
    with pytest.raises(ManifestMismatch, match=r"options.converted_from"):
        convert_cache(ConvertConfig(source=other, out=out, codec="fp8"))
    with pytest.raises(ValueError, match="already stored with codec 'lossless'"):
        convert_cache(ConvertConfig(source=src, out=tmp_path / "same", codec="lossless"))
    with pytest.raises(ValueError, match="is the source cache"):
        ConvertConfig(source=src, out=src, codec="q4")
    incomplete = tmp_path / "incomplete"
    make_cache(incomplete, [3, 4], complete=False)
    with pytest.raises(ShardError, match="incomplete"):
        convert_cache(ConvertConfig(source=incomplete, out=tmp_path / "x", codec="q4"))
    no_parts = tmp_path / "no-parts"
    make_cache(no_parts, [3, 4])
    shutil.rmtree(no_parts / "target")
    with pytest.raises(ShardError, match=r"config\.json: missing, the manifest records it"):
        convert_cache(ConvertConfig(source=no_parts, out=tmp_path / "y", codec="q4"))
    resign_manifest(no_parts, lambda d: d.pop("target_files"))  # a cache from before the digests
    with pytest.raises(FileNotFoundError, match=r"config\.json is missing"):
        convert_cache(ConvertConfig(source=no_parts, out=tmp_path / "y", codec="q4"))
    assert not (tmp_path / "y").exists()


def test_cli_converts_and_reports_bad_input_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    src = _source(tmp_path / "src", 4, per_shard=2)
    out = tmp_path / "q4"
    assert shards_main(["convert", str(src), "--codec", "q4", "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["shards"] == 2 and report["rows"] == 4 and report["bytes_out"] < report["bytes_in"]
    assert shards_main(["verify", str(out)]) == 0
    capsys.readouterr()
    assert shards_main(["convert", str(src), "--codec", "q4", "--out", str(src)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is the source cache" in err[0]
    assert (
        shards_main(["convert", str(tmp_path / "nope"), "--codec", "q4", "--out", str(tmp_path / "y")]) == 2
    )


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda c: copy_shard(c, 0, 3), "row 0 is stored in both shard-000000.dfs and shard-000003.dfs"),
        (lambda c: repeat_row(c, 2, 0, 1), "row 1 is stored in both shard-000000.dfs and shard-000002.dfs"),
    ],
)
def test_a_row_stored_twice_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture, damage, message: str
) -> None:
    """Convert wrote such a row twice; every index is read up front (not the data), so the refusal comes
    before --out is created even when the manifest's counts add up (the relabelled row)."""
    src = _source(tmp_path / "src", 9, per_shard=3)
    damage(src)
    out = tmp_path / "out"
    assert shards_main(["convert", str(src), "--codec", "fp8", "--out", str(out)]) == 2
    line = one_error_line(capsys.readouterr().err, "dflash-shards")
    assert message in line and f"dflash-shards verify {src}" in line
    assert not out.exists()


@given(
    lengths=st.lists(st.integers(1, 300), max_size=40),
    hidden=st.integers(1, 64),
    limit=st.integers(1, 5000),
)
def test_sample_groups_cover_every_sample_in_order_within_the_limit(
    lengths: list[int], hidden: int, limit: int
) -> None:
    groups = sample_groups(lengths, hidden, limit)
    assert [i for g in groups for i in g] == list(range(len(lengths)))
    for g in groups:
        size = sum(lengths[i] for i in g) * hidden
        assert size <= limit or len(g) == 1  # a sample larger than the limit travels alone
    for a, b in itertools.pairwise(groups):  # greedy: the next sample did not fit
        assert (sum(lengths[i] for i in a) + lengths[b[0]]) * hidden > limit
