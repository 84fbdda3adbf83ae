"""Re-running the extract command on a complete cache whose shards were lost or cut short since (a partial
copy, a disk error) extracts those shards again; a shard that reads whole but is not the one listed is
refused, never deleted. Before, the run said "complete" and exited 0 with the shard still missing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from dflash.extract.pipeline import run_extraction
from dflash.shards.cache import Cache
from dflash.shards.errors import ShardError
from dflash.shards.manifest import load_manifest
from dflash.shards.verify import verify_cache

from tests.common.extract import make_config, tiny_rows, write_dataset
from tests.common.targets import make_target

UNIT_BYTES = 6 << 10  # several shards for this dataset


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("repair")
    target, dataset = make_target(root, "qwen3"), write_dataset(root, tiny_rows(60, seed=5, max_len=40))
    reference = root / "reference"
    assert run_extraction(make_config(target, dataset, reference, unit_bytes=UNIT_BYTES)).complete
    assert len(load_manifest(reference).shards) >= 4
    return target, dataset, reference


def _copy(inputs: tuple[Path, Path, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(inputs[2], tmp_path / "cache"))


def _rerun(inputs: tuple[Path, Path, Path], cache: Path):
    target, dataset, _ = inputs
    return run_extraction(make_config(target, dataset, cache, unit_bytes=UNIT_BYTES))


@pytest.mark.parametrize("damage", ["missing", "cut short"])
def test_lost_shards_are_extracted_again(inputs, tmp_path: Path, caplog, damage: str) -> None:
    cache = _copy(inputs, tmp_path)
    names = [s.name for s in load_manifest(cache).shards]
    lost = [names[1], names[-1]]
    kept = {n: (cache / "shards" / n).stat().st_mtime_ns for n in names if n not in lost}
    for name in lost:
        path = cache / "shards" / name
        if damage == "missing":
            path.unlink()
        else:
            with path.open("r+b") as f:
                f.truncate(path.stat().st_size // 2)
    with caplog.at_level("WARNING"):
        result = _rerun(inputs, cache)
    assert result.complete and result.units_done == len(lost)
    assert any("2 of" in r.getMessage() and "extracting them again" in r.getMessage() for r in caplog.records)
    # The same cache as before the loss: the same shards (CPU extraction is deterministic), others untouched.
    assert load_manifest(cache).shards == load_manifest(inputs[2]).shards
    assert {n: (cache / "shards" / n).stat().st_mtime_ns for n in kept} == kept
    with Cache.open(cache) as c:
        assert verify_cache(c).ok


def test_a_whole_shard_of_another_cache_is_refused_not_deleted(inputs, tmp_path: Path) -> None:
    cache = _copy(inputs, tmp_path)
    names = [s.name for s in load_manifest(cache).shards]
    foreign = cache / "shards" / names[0]
    shutil.copyfile(cache / "shards" / names[1], foreign)  # reads whole, another size
    before = foreign.read_bytes()
    with pytest.raises(
        ShardError, match=rf"{names[0]}: \d+ bytes, the manifest records \d+, yet it reads as a whole"
    ):
        _rerun(inputs, cache)
    assert foreign.read_bytes() == before and load_manifest(cache).complete
