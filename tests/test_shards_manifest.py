"""Manifest round trips, provenance diffs, version refusal, and verify's row-coverage checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from common.synth import make_cache
from dflash.shards import (
    Cache,
    Manifest,
    ShardError,
    ShardInfo,
    diff_manifests,
    load_manifest,
    save_manifest,
    shard_name,
    target_fingerprint,
    target_info,
    verify_cache,
)
from dflash.shards.manifest import refuse_other_settings


def _manifest(**kw) -> Manifest:
    base = {
        "target": {"name_or_path": "Qwen/Qwen3-8B", "model_type": "qwen3", "config_sha256": "ab"},
        "layers": [1, 9, 17],
        "hidden_size": 4096,
        "codec": {"name": "lossless", "level": 1},
        "dataset": {"rows": 10, "length_hash": "x"},
        "options": {"max_length": 4096},
        "plan": {"units": 3},
    }
    return Manifest(**{**base, **kw})


def test_manifest_json_round_trip_and_atomic_save(tmp_path: Path) -> None:
    m = _manifest(
        skipped=[{"row": 3, "reason": "empty"}],
        shards=[
            ShardInfo(
                name="shard-000000.dfs", rows=2, tokens=9, bytes=100, index_checksum="00ff", supervised=4
            )
        ],
        complete=True,
    )
    save_manifest(tmp_path, m)
    assert load_manifest(tmp_path) == m
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]  # no temp file left behind
    assert m.rows == 2 and m.tokens == 9
    d = json.loads((tmp_path / "manifest.json").read_text())
    assert d["format"] == "dflash-cache" and d["version"] == 1 and d["tool_version"]
    d["added_by_a_newer_writer"] = {"x": 1}  # unknown keys are ignored
    (tmp_path / "manifest.json").write_text(json.dumps(d))
    assert load_manifest(tmp_path) == m


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "expected a JSON object"),
        ('{"format": "other"}', "not a dflash cache"),
        ('{"format": "dflash-cache", "version": 2}', "version 2 is not supported"),
        ('{"format": "dflash-cache", "version": 1, "layers": "1,2"}', "layers"),
        ('{"format": "dflash-cache", "version": 1, "shards": [{"name": "a"}]}', "malformed shard entry"),
        ('{"format": "dflash-cache", "version": 1, "codec": "fp8"}', "'codec' must be an object"),
        ('{"format": "dflash-cache", "version": 1, "skipped": [3]}', "'skipped' must be a list"),
        ('{"format": "dflash-cache", "version": 1, "complete": "yes"}', "'complete' must be a bool"),
        (
            '{"format": "dflash-cache", "version": 1, "target_files": null}',
            "'target_files' must be an object",
        ),
        (
            '{"format": "dflash-cache", "version": 1, "target_files": {"../manifest.json": {"bytes": 1}}}',
            "target_files name '../manifest.json' is not a plain file name",
        ),
        (
            '{"format": "dflash-cache", "version": 1, "target_files": {"a.json": {"bytes": -1}}}',
            "target_files.a.json must be",
        ),
        (
            '{"format": "dflash-cache", "version": 1, "target_files": {"a": {"bytes": 1, "xxh3_128": "x"}}}',
            "target_files.a must be",
        ),
    ],
)
def test_bad_manifests_are_refused_with_the_path(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "manifest.json").write_text(content)
    with pytest.raises(ShardError, match=message) as info:
        load_manifest(tmp_path)
    assert str(tmp_path / "manifest.json") in str(info.value)


def test_target_files_round_trip_and_are_not_provenance(tmp_path: Path) -> None:
    """The digests of target/ describe files, not the hidden states: a resume or a training run never
    compares them (a cache that gains them, or whose target/ is rewritten, is the same cache)."""
    files = {"frozen.safetensors": {"bytes": 3, "xxh3_128": "0" * 32}, "config.json": {"bytes": 2}}
    m = _manifest(target_files=files)
    save_manifest(tmp_path, m)
    assert load_manifest(tmp_path).target_files == files
    assert json.loads((tmp_path / "manifest.json").read_text())["target_files"] == files
    assert diff_manifests(m, _manifest()) == []
    refuse_other_settings(m, _manifest(), "resume")


def test_missing_manifest_says_not_a_cache(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a dflash cache"):
        Cache.open(tmp_path)


def test_diff_manifests_names_each_differing_field() -> None:
    a = _manifest()
    assert diff_manifests(a, _manifest(complete=True, tool_version="9", shards=[])) == []
    b = _manifest(codec={"name": "fp8", "level": 1}, layers=[1, 9], options={"max_length": 4096, "x": 1})
    assert diff_manifests(a, b) == [
        "layers: [1, 9, 17] != [1, 9]",
        "codec.name: 'lossless' != 'fp8'",
        "options.x: missing != 1",
    ]
    assert diff_manifests(a.to_dict(), b, fields=["codec.name", "target.model_type"]) == [
        "codec.name: 'lossless' != 'fp8'"
    ]
    assert diff_manifests(a, _manifest(target={"model_type": "qwen3"})) == [
        "target.config_sha256: 'ab' != missing",
        "target.name_or_path: 'Qwen/Qwen3-8B' != missing",
    ]


def test_target_fingerprint_is_canonical_and_target_info_reads_text_config() -> None:
    cfg = {
        "model_type": "qwen3_5",
        "text_config": {"hidden_size": 5120, "num_hidden_layers": 64, "vocab_size": 248320},
    }
    reordered = json.loads(json.dumps(dict(reversed(list(cfg.items())))))
    assert target_fingerprint(cfg) == target_fingerprint(reordered)
    assert target_fingerprint(cfg) != target_fingerprint({**cfg, "model_type": "qwen3"})
    info = target_info(cfg, "/models/27b")
    assert info["hidden_size"] == 5120 and info["num_hidden_layers"] == 64 and info["vocab_size"] == 248320
    assert info["model_type"] == "qwen3_5" and info["config_sha256"] == target_fingerprint(cfg)


def test_verify_checks_rows_against_the_dataset(tmp_path: Path) -> None:
    make_cache(tmp_path, [3, 4, 5, 6, 7], rows_per_shard=2, skipped=((2, "too long"),))
    with Cache.open(tmp_path) as cache:
        assert verify_cache(cache, dataset_rows=5).ok
        report = verify_cache(cache, dataset_rows=7)
        assert not report.ok and report.problems == ["missing from the cache and not skipped: 2 rows (5, 6)"]
        report = verify_cache(cache, dataset_rows=3)
        assert report.problems == ["rows beyond the dataset's 3 rows: 2 rows (3, 4)"]
    m = load_manifest(tmp_path)
    m.skipped = []
    save_manifest(tmp_path, m)
    with Cache.open(tmp_path) as cache:
        assert verify_cache(cache, dataset_rows=5).problems == [
            "missing from the cache and not skipped: 1 rows (2)"
        ]


def test_verify_catches_duplicates_and_manifest_disagreements(tmp_path: Path) -> None:
    make_cache(tmp_path, [3, 4, 5], rows_per_shard=2)
    shards = tmp_path / "shards"
    (shards / shard_name(7)).write_bytes((shards / shard_name(0)).read_bytes())  # unlisted copy
    with Cache.open(tmp_path) as cache:
        report = verify_cache(cache, dataset_rows=3)
        assert report.bad_shards == {
            shard_name(7): [f"{shards / shard_name(7)}: committed shard not listed in the manifest"]
        }
    m = load_manifest(tmp_path)
    m.shards.append(ShardInfo(**{**m.shards[0].to_dict(), "name": shard_name(7)}))
    m.shards[1].tokens += 1
    save_manifest(tmp_path, m)
    with Cache.open(tmp_path, unique_rows=False) as cache:  # as `dflash-shards verify` opens it
        report = verify_cache(cache, dataset_rows=3)
    assert not report.ok
    assert "row 0 stored 2 times (in shard-000000.dfs, shard-000007.dfs)" in report.problems
    assert any("tokens is 5 but the manifest says 6" in p for p in report.bad_shards[shard_name(1)])
    # A manifest whose layout the shards' headers contradict: no shard is read through it (training neither).
    m.codec, m.layers = {"name": "fp8", "level": 1}, [1, 99]
    save_manifest(tmp_path, m)
    with Cache.open(tmp_path, unique_rows=False) as cache:
        report = verify_cache(cache, dataset_rows=3)
        with pytest.raises(ShardError, match="header disagrees with the manifest"):
            cache.read(0)
    for name in (shard_name(0), shard_name(1)):
        (line,) = report.bad_shards[name]
        assert "its header disagrees with the manifest" in line
        assert "codec {'name': 'lossless'" in line and "layers [1, 3] != manifest [1, 99]" in line
    (shards / shard_name(7)).unlink()
    with Cache.open(tmp_path, unique_rows=False) as cache:
        report = verify_cache(cache)
    assert report.bad_shards[shard_name(7)] == [
        f"{shards / shard_name(7)}: listed in the manifest but missing"
    ]


def test_decoder_config_reads_a_vlm_wrappers_text_config() -> None:
    from dflash.shards.manifest import target_info
    from dflash.shards.target_config import decoder_config

    plain = {"model_type": "qwen3", "num_hidden_layers": 36, "hidden_size": 4096}
    assert decoder_config(plain) == plain
    wrapped = {
        "model_type": "qwen3_5",
        "vocab_size": 1,  # a stale wrapper value: the text model's own wins
        "text_config": {"num_hidden_layers": 64, "hidden_size": 5120, "vocab_size": 248320},
    }
    assert decoder_config(wrapped)["vocab_size"] == 248320
    info = target_info(wrapped, "/m")
    assert (info["model_type"], info["num_hidden_layers"], info["hidden_size"]) == ("qwen3_5", 64, 5120)
