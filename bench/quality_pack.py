"""The quality benchmark's work folders: each target's phases in its own folder, and `pack` / `unpack` of its
target/ and data/ as gzipped tar parts, to carry a trained target and its rows between machines."""

from __future__ import annotations

from pathlib import Path


def pack_name(kind: str) -> str:
    """The parts' name: each target's own, so one folder carries several."""
    return "quality-work.tgz" if kind == "code" else f"quality-work-{kind}.tgz"


def target_work(work: Path, kind: str) -> Path:
    """Where a target's phases keep their outputs: --work itself for code (as before), a subfolder else."""
    return work if kind == "code" else work / kind


def pack(work: Path, dest: Path, part_bytes: int = 16 * 2**20 - 2**16, kind: str = "code") -> list[Path]:
    """target/ and data/ as gzipped tar parts small enough to travel back from a GPU machine (16 MiB a file;
    gzip takes the rows' token ids to about half, so a target and its rows need two parts, not three)."""
    import tarfile

    dest.mkdir(parents=True, exist_ok=True)
    tar_path = dest / pack_name(kind)
    with tarfile.open(tar_path, "w:gz", compresslevel=6) as tar:
        for name in ("target", "data"):
            tar.add(work / name, arcname=name)
    blob = tar_path.read_bytes()
    tar_path.unlink()
    parts = []
    for i in range(0, len(blob), part_bytes):
        part = dest / f"{tar_path.name}.{i // part_bytes:02d}"
        part.write_bytes(blob[i : i + part_bytes])
        parts.append(part)
    return parts


def unpack(src: Path, work: Path, kind: str = "code") -> bool:
    """The inverse of `pack` (no-op when target/ is already there or no parts exist)."""
    import io
    import tarfile

    parts = sorted(src.glob(f"{pack_name(kind)}.*"))
    if (work / "target").exists() or not parts:
        return False
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts))) as tar:
        tar.extractall(work, filter="data")
    return True
