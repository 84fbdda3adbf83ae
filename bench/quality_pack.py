"""The quality benchmark's work folders: each target's phases in its own folder, the check that a folder was
built for the size asked, and `pack` / `unpack` of what a later machine needs as compressed tar parts: the trained
target and its rows ("work"), and the extraction's Triton cache ("triton")."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.quality_sizes import Size

# The extraction's Triton cache (`TRITON_CACHE_DIR` of every `dflash-extract` the benchmark runs). Some of FLA's
# kernels autotune again for each batch shape, so the hybrid target's extraction took 222 s cold and 74 s with
# this cache from an earlier machine of the same kind (BENCHMARKS.md). A CPU run leaves it empty (no Triton
# there); whether the Qwen3 targets' uncompiled extraction writes anything to it is not checked.
TRITON_CACHE = "triton-extract"

# What each pack holds: folders of a target's work folder; the first one's presence means "already there".
PACKED = {"work": ("target", "data"), "triton": (TRITON_CACHE,)}


# xz, not gzip: a full-size target and its rows are 23.5 MB against 28.0 MB (31 s to pack on this box against 3
# s; unpacking takes 1.7 s), so two targets' packs and the device wheels fit one call's 64 MiB `carry`, where
# gzip's went over by 3 MB. Packs written as .tgz by earlier sessions still unpack.
PACK_SUFFIX = ".txz"
_LEGACY_SUFFIX = ".tgz"


def pack_name(kind: str, what: str = "work", suffix: str = PACK_SUFFIX) -> str:
    """The parts' name: each target's own, so one folder carries several."""
    if what == "triton":
        return f"quality-triton-{kind}{suffix}"
    return f"quality-work{suffix}" if kind == "code" else f"quality-work-{kind}{suffix}"


def target_work(work: Path, kind: str) -> Path:
    """Where a target's phases keep their outputs: --work itself for code (as before), a subfolder else."""
    return work if kind == "code" else work / kind


# Settings that do not change the trained target (how fast it trained), left out of the comparison below.
_SPEED_ONLY = frozenset({"compile"})


def target_done(work: Path) -> Path:
    """The file a target's build writes last (its spec and digests): its presence means the target is built."""
    return work / "target" / "bench_target.json"


def nested_work(work_arg: Path, kind: str) -> str | None:
    """Where `--work W` finds no target but `bench/quality_targets.sh start W` built one: it passes W/T as each
    target's --work, so the hybrid's phases sit in W/hybrid/hybrid. Passing W would rebuild the target from
    scratch beside them (ten minutes of a GPU call went so)."""
    here, there = target_work(work_arg, kind), target_work(work_arg / kind, kind)
    if target_done(here).is_file() or not target_done(there).is_file():
        return None
    return f"{here} holds no target, {there} does (bench/quality_targets.sh's layout): pass --work {work_arg / kind}"


def work_mismatch(work: Path, size: Size) -> str | None:
    """What in `work` was built for another size or target than `size` (phases are reused when their outputs
    exist, so a --work of another size would otherwise train and score drafters on the wrong target)."""
    done = target_done(work)
    if done.is_file():
        built = json.loads(done.read_text()).get("spec", {})
        built.setdefault("kind", "code")  # written before there were other targets
        wanted = asdict(size.target)
        differ = [k for k in wanted if k in built and k not in _SPEED_ONLY and built[k] != wanted[k]]
        if differ:
            shown = ", ".join(f"{k} {built[k]} (wants {wanted[k]})" for k in differ)
            return f"{done.parent} is another target: {shown}"
    rows = work / "data" / "rows.json"
    if rows.is_file():
        meta = json.loads(rows.read_text())
        spec = size.data
        if (meta["train_rows"], len(meta["eval_rows"])) != (spec.train_rows, spec.eval_rows):
            return (f"{rows.parent} holds {meta['train_rows']} training and {len(meta['eval_rows'])} evaluation "
                    f"rows (wants {spec.train_rows} and {spec.eval_rows})")  # fmt: skip
    return None


def pack(
    work: Path, dest: Path, part_bytes: int = 16 * 2**20 - 2**16, kind: str = "code", what: str = "work"
) -> list[Path]:
    """`what`'s folders as xz-compressed tar parts small enough to travel back from a GPU machine (16 MiB a
    file: a full-size target and its rows need two). No parts (and nothing written) when the first folder is
    missing or empty, as a CPU run's Triton cache is."""
    import io
    import tarfile

    names = PACKED[what]
    if not any((work / names[0]).glob("*")):
        return []
    # in memory (tens of MB), not in `dest`: a poll copying `dest` sees whole parts only
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz", preset=6) as tar:
        for name in names:
            tar.add(work / name, arcname=name)
    blob = buffer.getvalue()
    dest.mkdir(parents=True, exist_ok=True)
    parts = []
    for i in range(0, len(blob), part_bytes):
        part = dest / f"{pack_name(kind, what)}.{i // part_bytes:02d}"
        hidden = part.with_name(f".{part.name}.tmp")  # `cp dest/*` passes it by; renamed when whole
        hidden.write_bytes(blob[i : i + part_bytes])
        hidden.replace(part)
        parts.append(part)
    return parts


def unpack(src: Path, work: Path, kind: str = "code", what: str = "work") -> bool:
    """The inverse of `pack` (no-op when the pack's first folder is already there or no parts exist)."""
    import io
    import tarfile

    parts = sorted(src.glob(f"{pack_name(kind, what)}.*")) or sorted(
        src.glob(f"{pack_name(kind, what, _LEGACY_SUFFIX)}.*")
    )
    if (work / PACKED[what][0]).exists() or not parts:
        return False
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts))) as tar:  # any compression
        tar.extractall(work, filter="data")
    return True
