"""The quality benchmark's packs: a target and its rows (and the extraction's Triton cache) carried between
device calls in whole tar parts, old parts still read."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import bench_quality, quality_phases


def test_the_extractions_triton_cache_travels_in_the_pack_to_the_next_machine(
    tmp_path: Path, monkeypatch
) -> None:
    """FLA autotunes per batch shape: a hybrid extraction ran 222 s cold and 74 s on a carried cache."""
    from bench.quality_pack import TRITON_CACHE

    seen: list[dict] = []

    def fake_call(cmd: list[str], log: Path, env: dict | None = None) -> float:
        seen.append(env or {})  # as dflash-extract on a GPU: its Triton cache lands where it was pointed
        kernel = Path(env["TRITON_CACHE_DIR"]) / "k1" / "autotune.json"
        kernel.parent.mkdir(parents=True, exist_ok=True)
        kernel.write_text('{"config": "BT=64"}')
        return 0.0

    monkeypatch.setattr(bench_quality, "phase_target", lambda *a: ({}, None, [], []))
    monkeypatch.setattr(bench_quality, "phase_data", lambda *a: {})
    monkeypatch.setattr(quality_phases, "_call", fake_call)
    first, packs = tmp_path / "first", tmp_path / "packs"
    argv = [
        "--size",
        "ci",
        "--device",
        "cpu",
        "--target",
        "hybrid",
        "--codecs",
        "fp8",
        "--stop-after",
        "extract",
    ]
    assert bench_quality.main([*argv, "--work", str(first), "--pack", str(packs)]) == 0
    assert seen == [{"TRITON_CACHE_DIR": str(first / "hybrid" / TRITON_CACHE)}]
    # No target/ was built here (phases faked), so only the Triton cache was packed.
    assert [p.name for p in packs.iterdir()] == ["quality-triton-hybrid.txz.00"]

    def cache_was_unpacked(work: Path, codec: str, device: str, token_budget: int) -> Path:
        assert (work / TRITON_CACHE / "k1" / "autotune.json").read_text() == '{"config": "BT=64"}'
        return work / f"cache-{codec}"

    monkeypatch.setattr(bench_quality, "phase_cache", cache_was_unpacked)
    second = tmp_path / "second"
    assert bench_quality.main([*argv, "--work", str(second), "--unpack", str(packs)]) == 0
    assert (second / "hybrid" / TRITON_CACHE).is_dir()
    # A target whose extraction left no Triton cache (a CPU's, a Qwen3's) packs nothing for it.
    assert bench_quality.pack(tmp_path / "none", packs, kind="code", what="triton") == []


def test_a_pack_shows_its_folder_whole_parts_only_while_it_writes(tmp_path: Path, monkeypatch) -> None:
    """`quality_targets.sh poll` copies the pack folder every 30 s while the build runs: a whole tar or a part
    half written there went back with a device call (one of its 8 files) and fails when unpacked."""
    import tarfile

    from bench.quality_pack import pack, unpack

    dest = tmp_path / "pack"
    seen: list[str] = []  # every name a `cp dest/*` could have copied while pack wrote
    exposed: list[str] = []  # files written under the name a copy takes: copied half written

    def visible() -> None:
        if dest.is_dir():
            seen.extend(p.name for p in dest.glob("*"))

    add, write = tarfile.TarFile.add, Path.write_bytes

    def spied_add(self: tarfile.TarFile, *args, **kwargs) -> None:
        visible()  # while the tar is built
        add(self, *args, **kwargs)

    def spied_write(self: Path, data: bytes) -> int:
        visible()
        if self.parent == dest and not self.name.startswith("."):
            exposed.append(self.name)
        return write(self, data)

    monkeypatch.setattr(tarfile.TarFile, "add", spied_add)
    monkeypatch.setattr(Path, "write_bytes", spied_write)
    work = tmp_path / "w"
    (work / "target").mkdir(parents=True)
    (work / "target" / "weights.bin").write_bytes(bytes(range(256)) * 512)
    (work / "data").mkdir()
    parts = pack(work, dest, part_bytes=100, kind="hybrid")
    assert len(parts) > 2 and sorted(p.name for p in dest.iterdir()) == [p.name for p in parts]
    assert set(seen) <= {p.name for p in parts} and not exposed, (seen, exposed)
    assert unpack(dest, tmp_path / "w2", "hybrid")
    assert (tmp_path / "w2" / "target" / "weights.bin").read_bytes() == bytes(range(256)) * 512


@pytest.mark.slow
def test_a_pack_of_an_earlier_session_in_gzip_parts_still_unpacks(tmp_path: Path) -> None:
    """Packs are xz now; the .tgz parts earlier sessions kept (and BENCHMARKS' commands name) must still load,
    and a folder holding both kinds takes the new one."""
    import io
    import tarfile

    from bench.quality_pack import pack, unpack

    def tgz_parts(dest: Path, text: str) -> None:
        blob = io.BytesIO()
        with tarfile.open(fileobj=blob, mode="w:gz") as tar:
            data = text.encode()
            info = tarfile.TarInfo("target/config.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        raw = blob.getvalue()
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "quality-work-hybrid.tgz.00").write_bytes(raw[: len(raw) // 2])
        (dest / "quality-work-hybrid.tgz.01").write_bytes(raw[len(raw) // 2 :])

    old = tmp_path / "old"
    tgz_parts(old, '{"old": true}')
    assert unpack(old, tmp_path / "w1", "hybrid")
    assert (tmp_path / "w1" / "target" / "config.json").read_text() == '{"old": true}'
    assert not unpack(old, tmp_path / "w1", "hybrid")  # already there: nothing overwritten

    fresh = tmp_path / "fresh"
    (fresh / "target").mkdir(parents=True)
    (fresh / "target" / "config.json").write_text('{"new": true}')
    (fresh / "data").mkdir()
    parts = pack(fresh, old, kind="hybrid")
    assert [p.name for p in parts] == ["quality-work-hybrid.txz.00"]
    assert unpack(old, tmp_path / "w2", "hybrid")
    assert (tmp_path / "w2" / "target" / "config.json").read_text() == '{"new": true}'
