"""`dflash-shards` subcommands: JSON keys, exit codes, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from common.datasets import write_ones_stream
from common.synth import make_cache
from dflash.shards import shard_name
from dflash.tools.shards_cli import main


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "cache"
    make_cache(
        path, [5, 60, 7, 300, 2], layers=(2, 5), hidden=64, rows_per_shard=3, skipped=((1, "too long"),)
    )
    return path


def _json(capsys: pytest.CaptureFixture[str], argv: list[str], rc: int = 0) -> dict:
    assert main(argv) == rc
    return json.loads(capsys.readouterr().out)


def test_info_json(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _json(capsys, ["info", str(cache), "--json"])
    assert d["samples"] == 4 and d["tokens"] == 5 + 7 + 300 + 2 and d["layers"] == [2, 5]
    assert d["raw_bytes"] == d["tokens"] * 2 * 64 * 2
    assert d["bytes"] == sum(p.stat().st_size for p in (cache / "shards").iterdir())
    assert d["codec"] == {"name": "lossless", "level": 1} and d["skipped"] == 1 and d["complete"] is True
    assert main(["info", str(cache)]) == 0
    assert "ratio" in capsys.readouterr().out


def test_ls_json(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _json(capsys, ["ls", str(cache), "--json"])
    assert [(s["name"], s["rows"]) for s in d["shards"]] == [(shard_name(0), 3), (shard_name(1), 1)]
    assert {"name", "rows", "tokens", "bytes"} <= set(d["shards"][0])


def test_show_json_and_missing_rows(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _json(capsys, ["show", str(cache), "3", "--json"])
    assert d["row"] == 3 and d["length"] == 300 and d["supervised"] == 200
    assert set(d["layers"]) == {"2", "5"}
    assert (
        set(d["layers"]["5"]) == {"mean", "std", "absmax", "nonfinite"} and d["layers"]["5"]["nonfinite"] == 0
    )
    assert d["layers"]["5"]["absmax"] > d["layers"]["5"]["std"] > 0
    assert main(["show", str(cache), "1"]) == 2
    assert "skipped at extraction (too long)" in capsys.readouterr().err
    assert main(["show", str(cache), "-4"]) == 2


def test_stats_json(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _json(capsys, ["stats", str(cache), "--sample", "2", "--json"])
    assert d["rows"] == 4 and d["rows_sampled"] == 2 and set(d["layers"]) == {"2", "5"}
    assert sum(b["count"] for b in d["length_histogram"]) == 4
    assert d["lengths"]["max"] == 300 and d["lengths"]["min"] == 2
    assert main(["stats", str(cache), "--sample", "0"]) == 2


def test_verify_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_cache(tmp_path / "c", [4, 5, 6], rows_per_shard=2)
    d = _json(capsys, ["verify", str(tmp_path / "c"), "--json"])
    assert d["ok"] is True and d["samples_checked"] == 3
    shard = tmp_path / "c" / "shards" / shard_name(1)
    data = bytearray(shard.read_bytes())
    data[20] ^= 0x40
    shard.write_bytes(bytes(data))
    d = _json(capsys, ["verify", str(tmp_path / "c"), "--json"], rc=1)
    assert d["ok"] is False and list(d["bad_shards"]) == [shard_name(1)]
    assert main(["verify", str(tmp_path / "c")]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAILED") and str(shard) in out
    assert main(["verify", str(tmp_path / "nope")]) == 2
    assert "not a dflash cache" in capsys.readouterr().err


def test_verify_against_a_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_cache(tmp_path / "c", [4, 5, 6], rows_per_shard=2)
    ds = write_ones_stream(tmp_path / "ds", [4, 5, 6, 7])
    d = _json(capsys, ["verify", str(tmp_path / "c"), "--dataset", str(ds), "--json"], rc=1)
    assert d["problems"] == [
        "the dataset's row count differs from the dataset this cache was extracted from "
        "(manifest dataset.rows 3, the dataset's 4)",
        "missing from the cache and not skipped: 1 rows (3)",
    ]


def test_plan_forwards_flags_to_the_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.common.datasets import make_rows, write_save_to_disk, write_target_config

    dataset = write_save_to_disk(make_rows(30, seed=2, min_len=4, max_len=40, vocab=500), tmp_path / "ds")
    target = write_target_config(tmp_path / "target", num_hidden_layers=8, hidden_size=64, vocab_size=512)
    code = main(["plan", "--target", str(target), "--dataset", str(dataset), "--layers", "1,5", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rows"] + report["rows_skipped"] == 30 and report["batches"] >= 1
