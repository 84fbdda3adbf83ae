"""End-to-end extraction on CPU: exactness against plain HF forwards, coverage, resume rules, disk."""

from __future__ import annotations

import errno
import json
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from dflash.extract import pipeline
from dflash.extract.pipeline import run_extraction
from dflash.extract.units import CacheLocked, assign_units
from dflash.shards.cache import Cache
from dflash.shards.errors import DiskFull, ManifestMismatch
from dflash.shards.manifest import load_manifest
from dflash.shards.outdir import claim_out_dir
from dflash.shards.verify import verify_cache
from dflash.shards.writer import ShardWriter
from safetensors import safe_open

from tests.common.extract import LAYERS, make_config, samples_by_row, shard_bytes, tiny_rows, write_dataset
from tests.common.targets import load_reference, make_target, reference_layer_outputs


@pytest.fixture(scope="module")
def rows() -> list:
    rows = tiny_rows(24)
    rows[7] = (rows[7][0][:1], rows[7][1][:1] * 0 + 1)  # a one-token row
    long_ids = torch.randint(3, 256, (45,), generator=torch.Generator().manual_seed(9)).numpy()
    rows[9] = (long_ids, (long_ids * 0 + 1))  # longer than max_len 32: truncated
    return rows


def kept_rows(rows: list) -> list[int]:
    """Rows validate() keeps at max_len 32: non-empty with a supervised token in the first 32."""
    return [r for r, (ids, mask) in enumerate(rows) if len(ids) and mask[:32].sum()]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory, rows: list) -> Path:
    return write_dataset(tmp_path_factory.mktemp("ds"), rows)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_target(tmp_path_factory.mktemp("t"), "qwen3")


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5_text", "qwen3_next"])
def test_cache_equals_unpadded_hf_forward(tmp_path: Path, dataset: Path, rows: list, kind: str) -> None:
    target = make_target(tmp_path, kind)
    cfg = make_config(target, dataset, tmp_path / "cache", unit_bytes=8 << 10)
    result = run_extraction(cfg)
    assert result.complete and result.units_total >= 2
    kept = kept_rows(rows)
    assert 3 not in kept and 5 not in kept
    assert result.rows == len(kept) and result.rows_skipped == len(rows) - len(kept)

    with Cache.open(tmp_path / "cache") as cache:
        report = verify_cache(cache, dataset_rows=len(rows))
        assert report.ok, report.lines()
        entries = cache.entries()
        assert Counter(e.row for e in entries) == Counter(kept)  # each kept row exactly once
        assert sorted(s["row"] for s in cache.manifest.skipped) == sorted(set(range(len(rows))) - set(kept))
        assert cache.layers == LAYERS and cache.manifest.dtype == "float32"
        reference = load_reference(target)
        for row in kept:
            ids, mask = rows[row]
            n = min(len(ids), 32)
            sample = cache.read(row)
            assert sample.length == n  # no padding stored, overlong rows truncated
            assert torch.equal(sample.input_ids, torch.as_tensor(ids[:n], dtype=torch.int64))
            assert torch.equal(sample.loss_mask, torch.as_tensor(mask[:n]).bool())
            expected = reference_layer_outputs(reference, sample.input_ids, LAYERS)
            for layer, exp in zip(LAYERS, expected, strict=True):
                diff = (sample.hidden[layer] - exp).abs().max().item()
                assert diff <= 1e-5, f"{kind} row {row} layer {layer}: max abs diff {diff}"


def test_vlm_wrapped_qwen3_5_target(tmp_path: Path, dataset: Path) -> None:
    """The VLM-wrapped qwen3_5 checkpoint: text-only extraction, frozen parts from model.language_model.*."""
    from safetensors.torch import load_file

    target = make_target(tmp_path, "qwen3_5")
    result = run_extraction(make_config(target, dataset, tmp_path / "cache", layers=[1]))
    assert result.complete
    stored = load_file(str(target / "model.safetensors"))
    with safe_open(tmp_path / "cache" / "target" / "frozen.safetensors", framework="pt") as f:
        embed = f.get_tensor("embed_tokens.weight")
    assert torch.equal(embed, stored["model.language_model.embed_tokens.weight"].to(torch.bfloat16))
    with Cache.open(tmp_path / "cache") as cache:
        assert cache.manifest.target["model_type"] == "qwen3_5" and cache.manifest.hidden_size == 64
        reference = load_reference(target)
        sample = cache.read(cache.entries()[0].row)
        (expected,) = reference_layer_outputs(reference, sample.input_ids, [1])
        assert (sample.hidden[1] - expected).abs().max() <= 1e-5


@pytest.mark.parametrize(("codec", "min_ratio", "max_error"), [("fp8", 1.75, 0.05), ("q4", 2.5, 0.15)])
def test_quantized_cache_close_to_reference(
    tmp_path: Path, dataset: Path, qwen3: Path, codec: str, min_ratio: float, max_error: float
) -> None:
    """Quantized on the (CPU stand-in for the) GPU per batch, each sample as its own frame."""
    result = run_extraction(make_config(qwen3, dataset, tmp_path / "cache", codec=codec))
    # vs the raw states in the stored dtype, bf16: 2 bytes -> ~1 byte (fp8) or less (q4) + scales, then zstd
    assert result.complete and result.raw_dtype == "bfloat16" and result.ratio > min_ratio
    reference = load_reference(qwen3)
    with Cache.open(tmp_path / "cache") as cache:
        assert cache.manifest.dtype == "bfloat16"
        for e in cache.entries()[:6]:
            sample = cache.read(e.row)
            expected = reference_layer_outputs(reference, sample.input_ids, LAYERS)
            for layer, exp in zip(LAYERS, expected, strict=True):
                got = sample.hidden[layer].float()
                assert (got - exp).norm() / exp.norm() < max_error


def test_rerun_of_complete_cache_does_nothing_and_parts_are_written(
    tmp_path: Path, dataset: Path, qwen3: Path
) -> None:
    cfg = make_config(qwen3, dataset, tmp_path / "cache")
    run_extraction(cfg)
    before = shard_bytes(tmp_path / "cache")
    again = run_extraction(cfg)
    assert again.complete and again.units_done == 0 and shard_bytes(tmp_path / "cache") == before
    parts = tmp_path / "cache" / "target"
    assert (parts / "config.json").read_bytes() == (qwen3 / "config.json").read_bytes()
    with safe_open(parts / "frozen.safetensors", framework="pt") as f:
        assert set(f.keys()) == {"embed_tokens.weight", "lm_head.weight", "final_norm.gain"}


@pytest.mark.parametrize(
    "change,field",
    [
        ({"codec": "fp8"}, "codec.name"),
        ({"layers": [0, 2]}, "layers"),
        ({"max_len": 16}, "options.max_len"),
        ({"token_budget": 128}, "options.token_budget"),
    ],
)
def test_resume_with_changed_option_is_refused(
    tmp_path: Path, dataset: Path, qwen3: Path, change: dict, field: str
) -> None:
    out = tmp_path / "cache"
    run_extraction(make_config(qwen3, dataset, out))
    manifest_before = (out / "manifest.json").read_bytes()
    with pytest.raises(ManifestMismatch, match=r"\b" + re.escape(field) + ":"):
        run_extraction(make_config(qwen3, dataset, out, **change))
    assert (out / "manifest.json").read_bytes() == manifest_before


def test_other_target_refused(tmp_path: Path, dataset: Path, qwen3: Path) -> None:
    out = tmp_path / "cache"
    run_extraction(make_config(qwen3, dataset, out))
    other = make_target(tmp_path / "other", "qwen3_5_text")
    with pytest.raises(ManifestMismatch, match=r"target\.config_sha256"):
        run_extraction(make_config(other, dataset, out))


def test_not_a_cache_refused(tmp_path: Path, dataset: Path, qwen3: Path) -> None:
    out = tmp_path / "cache"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not written by dflash"):
        run_extraction(make_config(qwen3, dataset, out))


def test_lock_held_by_another_process(tmp_path: Path, dataset: Path, qwen3: Path) -> None:
    out = claim_out_dir(tmp_path / "cache", "cache")  # as the other extraction did before locking
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, json, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT);"
            "fcntl.lockf(fd, fcntl.LOCK_EX); os.write(fd, json.dumps({'pid': os.getpid(), 'host': 'h', 'world_size': 1}).encode());"
            "print('held', flush=True); time.sleep(60)",
            str(out / ".lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CacheLocked, match=rf"another extraction \(pid {holder.pid} on h"):
            run_extraction(make_config(qwen3, dataset, out))
    finally:
        holder.kill()
        holder.wait()
    assert run_extraction(make_config(qwen3, dataset, out)).complete


def test_disk_estimate_refuses_unless_forced(tmp_path: Path, dataset: Path, qwen3: Path, monkeypatch) -> None:
    class Usage:
        free = 1000

    monkeypatch.setattr(pipeline.shutil, "disk_usage", lambda path: Usage)
    with pytest.raises(ValueError, match="--force"):
        run_extraction(make_config(qwen3, dataset, tmp_path / "cache"))
    assert not (tmp_path / "cache" / "manifest.json").exists()
    assert run_extraction(make_config(qwen3, dataset, tmp_path / "cache", force=True)).complete


def test_enospc_mid_run_stops_cleanly_and_resumes(
    tmp_path: Path, dataset: Path, qwen3: Path, monkeypatch
) -> None:
    reference = tmp_path / "reference"
    run_extraction(make_config(qwen3, dataset, reference, unit_bytes=8 << 10))
    out = tmp_path / "cache"
    real_write = ShardWriter._write
    calls = {"n": 0}

    def failing_write(self: ShardWriter, data: bytes) -> None:
        calls["n"] += 1
        if calls["n"] > 60:  # a few shards in: fail inside one
            self._guard(lambda: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
        real_write(self, data)

    monkeypatch.setattr(ShardWriter, "_write", failing_write)
    with pytest.raises(DiskFull, match="no space left"):
        run_extraction(make_config(qwen3, dataset, out, unit_bytes=8 << 10))
    manifest = load_manifest(out)
    assert not manifest.complete
    committed = sorted(p.name for p in (out / "shards").iterdir())
    assert committed and all(
        not n.startswith(".") for n in committed
    )  # temp file of the failed shard removed
    assert len(committed) < len(shard_bytes(reference))
    monkeypatch.setattr(ShardWriter, "_write", real_write)
    result = run_extraction(make_config(qwen3, dataset, out, unit_bytes=8 << 10))
    assert result.complete and result.units_done == result.units_total - len(committed)
    assert shard_bytes(out) == shard_bytes(reference)


def test_stale_temp_files_are_discarded(tmp_path: Path, dataset: Path, qwen3: Path) -> None:
    out = tmp_path / "cache"
    cfg = make_config(qwen3, dataset, out, unit_bytes=8 << 10)
    run_extraction(cfg)
    shards = sorted((out / "shards").iterdir())
    # Simulate a kill: the manifest is incomplete again, one shard is missing, a torn temp file remains.
    manifest = load_manifest(out)
    manifest.complete, manifest.shards = False, []
    from dflash.shards.manifest import save_manifest

    save_manifest(out, manifest)
    torn = out / "shards" / f".{shards[1].name}.tmp-99999"
    torn.write_bytes(shards[1].read_bytes()[:100])
    shards[1].unlink()
    result = run_extraction(cfg)
    assert result.complete and result.units_done == 1
    assert not torn.exists()
    with Cache.open(out) as cache:
        assert verify_cache(cache, dataset_rows=24).ok


def test_rank0_takes_over_units_of_a_rank_that_never_started(
    tmp_path: Path, dataset: Path, rows: list, qwen3: Path, monkeypatch
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "cache"
    t = time.monotonic()
    result = run_extraction(make_config(qwen3, dataset, out, unit_bytes=8 << 10), takeover_grace_s=0.3)
    assert result.complete and result.units_done == result.units_total
    assert time.monotonic() - t < 60
    assert sorted(samples_by_row(out)) == kept_rows(rows)


def test_assign_units_is_a_partition_for_any_world_size() -> None:
    committed = {1, 4}
    for world in (1, 2, 3, 5):
        parts = [assign_units(10, committed, r, world) for r in range(world)]
        flat = sorted(u for p in parts for u in p)
        assert flat == [u for u in range(10) if u not in committed]


def test_json_output(tmp_path: Path, dataset: Path, qwen3: Path, capsys) -> None:
    run_extraction(make_config(qwen3, dataset, tmp_path / "cache", json=True))
    out = capsys.readouterr().out.strip().splitlines()[-1]
    d = json.loads(out)
    assert d["complete"] and d["tokens"] > 0 and d["bytes_per_token"] > 0
    assert set(d["stages"]) == {"gather", "forward", "d2h", "write"}


def test_worker_threads_run_torch_on_one_thread(
    tmp_path: Path, dataset: Path, qwen3: Path, monkeypatch
) -> None:
    """Encoders run torch on themselves alone; the thread running the (here CPU) forward keeps its count."""
    from dflash.extract import stages

    seen: set[int] = set()
    real_encode = stages.encode_sample

    def spy(*args):
        seen.add(torch.get_num_threads())
        return real_encode(*args)

    monkeypatch.setattr(stages, "encode_sample", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert run_extraction(make_config(qwen3, dataset, tmp_path / "cache")).complete
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen == {1}
