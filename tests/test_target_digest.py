"""The digests of CACHE/target/ (manifest `target_files`): bytes zeroed inside frozen.safetensors are finite
values nothing else can tell from real ones, so extraction records each file's size and xxh3-128 and
verify, training, convert and a re-run of the extraction compare them; a manifest without them (older
caches) is read as before. Each refusal is one line naming the file."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
from common.fake_cache import write_fake_cache
from common.hostile import one_error_line, resign_manifest
from dflash.extract.cli import main as extract_main
from dflash.shards import Cache, load_manifest, verify_cache
from dflash.tools.shards_cli import main as shards_main
from dflash.train.cli import main as train_main

from tests.common.extract import tiny_rows, write_dataset
from tests.common.targets import make_target
from tests.common.train_cli import tiny_train_argv

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TRAIN = ("--max-steps", "2", "--mask-token-id", "255", "--no-tensorboard", "--no-plots")


def _extract_argv(target: Path, dataset: Path, out: Path) -> list[str]:
    paths = ["--target", str(target), "--dataset", str(dataset), "--out", str(out)]
    return [*paths, "--device", "cpu", "--layers", "1,2", "--json"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("inputs")
    return make_target(root, "qwen3"), write_dataset(root, tiny_rows(12, max_len=24))


@pytest.fixture(scope="module")
def template(inputs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("template") / "cache"
    assert extract_main(_extract_argv(*inputs, out)) == 0
    return out


@pytest.fixture
def cache(template: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(template, tmp_path / "cache"))


def _zero_frozen_data(cache: Path) -> Path:
    """Zero 64 bytes in the middle of frozen.safetensors's tensor data: the header is untouched, so the file
    parses, and zeros are finite weights."""
    path = cache / "target" / "frozen.safetensors"
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    middle = (start + len(data)) // 2
    assert start < middle and data[middle : middle + 64] != bytes(64)
    data[middle : middle + 64] = bytes(64)
    path.write_bytes(bytes(data))
    return path


def _verify_lines(cache: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """`dflash-shards verify`'s exit code and its problem lines."""
    rc = shards_main(["verify", str(cache)])
    out = capsys.readouterr().out
    return rc, [line.strip() for line in out.splitlines()[1:]]


def _train(cache: Path, run: Path) -> int:
    return train_main(tiny_train_argv(cache, run, *TRAIN))


def test_extraction_records_every_target_file(cache: Path) -> None:
    files = load_manifest(cache).target_files
    on_disk = sorted(p.name for p in (cache / "target").iterdir())
    assert sorted(files) == on_disk and {"config.json", "frozen.safetensors", "tokenizer.json"} <= set(files)
    for name, entry in files.items():
        assert entry["bytes"] == (cache / "target" / name).stat().st_size
        assert len(entry["xxh3_128"]) == 32


def test_zeroed_frozen_bytes_fail_verify_training_and_convert(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    frozen = _zero_frozen_data(cache)
    rc, lines = _verify_lines(cache, capsys)
    assert rc == 1 and len(lines) == 1 and lines[0].startswith(f"{frozen}: damaged or replaced"), lines

    run = tmp_path / "run"
    assert _train(cache, run) == 2
    line = one_error_line(capsys.readouterr().err, "dflash-train")
    assert str(frozen) in line and "restore it from a copy" in line and "re-run" in line
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()  # before step 1

    out = tmp_path / "converted"
    assert shards_main(["convert", str(cache), "--codec", "fp8", "--out", str(out)]) == 2
    assert str(frozen) in one_error_line(capsys.readouterr().err, "dflash-shards")
    assert not (out / "target").exists()


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (
            lambda t: t.joinpath("config.json").write_text(t.joinpath("config.json").read_text() + " "),
            "bytes",
        ),
        (lambda t: t.joinpath("tokenizer.json").unlink(), "missing"),
        (lambda t: t.joinpath("notes.txt").write_text("mine"), "target_files"),
    ],
)
def test_each_target_file_is_held_to_its_record(
    cache: Path, capsys: pytest.CaptureFixture[str], damage, problem: str
) -> None:
    damage(cache / "target")
    rc, lines = _verify_lines(cache, capsys)
    assert rc == 1 and len(lines) == 1 and problem in lines[0] and str(cache / "target") in lines[0], lines


def test_a_fifo_in_place_of_a_target_file_is_named_not_waited_on(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = cache / "target" / "tokenizer.json"
    fifo.unlink()
    os.mkfifo(fifo)
    results: list[int] = []
    thread = threading.Thread(target=lambda: results.append(_train(cache, tmp_path / "run")), daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert results == [2], "training waits on a FIFO in target/"
    assert f"{fifo} is a FIFO, not a regular file" in one_error_line(capsys.readouterr().err, "dflash-train")


def test_null_tokenizer_is_refused_by_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = write_fake_cache(tmp_path / "cache", num_samples=8, samples_per_shard=4)
    resign_manifest(cache, lambda d: d.pop("target_files"))  # a cache from before the digests
    (cache / "target" / "tokenizer.json").write_text("null")
    rc, lines = _verify_lines(cache, capsys)
    assert rc == 1 and lines == [f"{cache / 'target' / 'tokenizer.json'}: holds JSON null, not an object"]


def test_null_tokenizer_with_digests_is_one_line(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (cache / "target" / "tokenizer.json").write_text("[]")
    rc, lines = _verify_lines(cache, capsys)
    assert rc == 1 and len(lines) == 1 and "tokenizer.json: " in lines[0], lines


def test_manifest_without_digests_still_verifies_and_trains(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert load_manifest(cache).target_files  # what the old manifest below lacks
    resign_manifest(cache, lambda d: d.pop("target_files"))
    assert "target_files" not in json.loads((cache / "manifest.json").read_text())
    assert load_manifest(cache).target_files == {}
    rc, lines = _verify_lines(cache, capsys)
    assert rc == 0 and lines == []
    assert _train(cache, tmp_path / "run") == 0


def test_clean_cache_verifies_trains_and_converts_with_its_digests(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _verify_lines(cache, capsys) == (0, [])
    assert _train(cache, tmp_path / "run") == 0
    out = tmp_path / "converted"
    assert shards_main(["convert", str(cache), "--codec", "q4", "--out", str(out)]) == 0
    files = load_manifest(cache).target_files
    assert files and load_manifest(out).target_files == files
    with Cache.open(out) as c:
        assert verify_cache(c).ok
    # A converted cache is held to the same record: damage in its copy is named.
    frozen = _zero_frozen_data(out)
    capsys.readouterr()
    rc, lines = _verify_lines(out, capsys)
    assert rc == 1 and len(lines) == 1 and lines[0].startswith(f"{frozen}: damaged or replaced")


def test_convert_of_a_source_without_digests_records_them(tmp_path: Path) -> None:
    source = write_fake_cache(tmp_path / "src", num_samples=8, samples_per_shard=4)
    resign_manifest(source, lambda d: d.pop("target_files"))  # a cache from before the digests
    assert load_manifest(source).target_files == {}
    out = tmp_path / "dst"
    assert shards_main(["convert", str(source), "--codec", "fp8", "--out", str(out)]) == 0
    files = load_manifest(out).target_files
    assert sorted(files) == sorted(p.name for p in (source / "target").iterdir())


def _interrupted(cache: Path) -> None:
    """The cache as a killed extraction leaves it: the last shard not committed, the manifest incomplete."""
    last = load_manifest(cache).shards[-1].name
    resign_manifest(cache, lambda d: d.update(complete=False, shards=[]))
    (cache / "shards" / last).unlink()


@pytest.mark.parametrize("interrupted", [False, True])
def test_rerunning_the_extraction_rewrites_damaged_target_parts(
    cache: Path, inputs: tuple[Path, Path], capsys: pytest.CaptureFixture[str], interrupted: bool
) -> None:
    frozen = cache / "target" / "frozen.safetensors"
    good, files = frozen.read_bytes(), load_manifest(cache).target_files
    _zero_frozen_data(cache)
    if interrupted:
        _interrupted(cache)
    assert extract_main(_extract_argv(*inputs, cache)) == 0
    assert frozen.read_bytes() == good and load_manifest(cache).target_files == files
    capsys.readouterr()
    assert _verify_lines(cache, capsys) == (0, [])


def test_rerun_on_a_cache_without_digests_records_them(
    cache: Path, inputs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    files = load_manifest(cache).target_files
    resign_manifest(cache, lambda d: d.pop("target_files"))
    _interrupted(cache)
    assert extract_main(_extract_argv(*inputs, cache)) == 0
    manifest = load_manifest(cache)
    assert manifest.complete and manifest.target_files == files


def test_demo_evaluation_refuses_a_damaged_target(cache: Path, tmp_path: Path) -> None:
    """The demo's evaluation reads the frozen target outside training, so it checks the digests too."""
    from dflash.shards import ShardError
    from dflash.tools.demo import DEMO_SIZES
    from dflash.tools.demo_eval import evaluate_drafter, make_train_config, untrained_drafter

    cfg = make_train_config(cache, tmp_path / "run", next(iter(DEMO_SIZES.values())), seed=0)
    drafter = untrained_drafter(cfg)
    assert "tau" in evaluate_drafter(drafter, cfg)
    _zero_frozen_data(cache)
    with pytest.raises(ShardError, match=r"frozen\.safetensors: damaged or replaced since written"):
        evaluate_drafter(drafter, cfg)
