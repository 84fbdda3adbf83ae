"""Tools of an attacker (or an unlucky disk) for the hostile-input tests: rewrite an index with valid
checksums, plant decompression bombs, re-sign a manifest, and run a CLI measuring its peak memory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import xxhash
from dflash.shards import EncodedSample, ShardMeta, ShardReader, ShardWriter, load_manifest, save_manifest
from dflash.shards.codec_base import compressor
from dflash.shards.layout import FOOTER, FOOTER_MAGIC, checksum
from dflash.shards.target_files import digest_files

_ZEROS = bytes(1 << 20)


def rewrite_index(
    path: Path, edit: Callable[[dict[str, Any]], object], raw_edit: Callable[[bytes], bytes] | None = None
) -> None:
    """Rewrite a shard's index like an attacker would: valid JSON, valid checksums, hostile content
    (`raw_edit` then changes the serialized bytes, for what json.dumps cannot write)."""
    data = path.read_bytes()
    off, length, _, _ = FOOTER.unpack(data[-FOOTER.size :])
    index = json.loads(data[off : off + length])
    edit(index)
    raw = json.dumps(index).encode()
    if raw_edit is not None:
        raw = raw_edit(raw)
    footer = FOOTER.pack(off, len(raw), xxhash.xxh3_64_intdigest(raw), FOOTER_MAGIC)
    path.write_bytes(data[:off] + raw + footer)


def resign_manifest(cache: Path, edit: Callable[[dict[str, Any]], object] | None = None) -> None:
    """Make the manifest agree with the shards on disk again (stats, index checksums), then `edit` it:
    what is left wrong is only what the test planted."""
    manifest = load_manifest(cache)
    infos = []
    for info in manifest.shards:
        with ShardReader.open(cache / "shards" / info.name) as reader:
            infos.append(reader.info())
    manifest.shards = infos
    if edit is None:
        save_manifest(cache, manifest)
        return
    d = manifest.to_dict()
    edit(d)
    (cache / "manifest.json").write_text(json.dumps(d))


def record_target_files(cache: Path) -> None:
    """Record target/'s files as they are now in the manifest's digests, as if extraction had written them
    so: a damage planted in target/ then reaches the checks after the digest one (shapes, dtypes, NaN)."""
    manifest = load_manifest(cache)
    manifest.target_files = digest_files(cache / "target")
    save_manifest(cache, manifest)


def copy_shard(cache: Path, unit: int, new_unit: int) -> str:
    """Copy shard `unit` under the name of `new_unit` and list the copy in the manifest too (a user copying a
    shard in, or a damaged manifest): each of its rows stored in two shards, every checksum valid."""
    copy = cache / "shards" / f"shard-{new_unit:06d}.dfs"
    shutil.copyfile(cache / "shards" / f"shard-{unit:06d}.dfs", copy)
    manifest = load_manifest(cache)
    with ShardReader.open(copy) as reader:
        manifest.shards.append(reader.info())
    save_manifest(cache, manifest)
    return copy.name


def repeat_row(cache: Path, unit: int, index: int, row: int) -> None:
    """Sample `index` of shard `unit` relabelled as `row` (stored elsewhere), the manifest re-signed: nothing
    in the manifest betrays it (its row counts still add up)."""
    rewrite_index(cache / "shards" / f"shard-{unit:06d}.dfs", lambda ix: ix["samples"][index].update(row=row))
    resign_manifest(cache)


def zstd_zeros(n: int, value: int = 0) -> bytes:
    """One zstd frame (content size declared) of n bytes equal to `value`, built in 1 MiB steps."""
    block = _ZEROS if value == 0 else bytes([value]) * len(_ZEROS)
    cobj = compressor(1).compressobj(size=n)
    parts = [cobj.compress(block) for _ in range(n // len(block))]
    parts += [cobj.compress(block[: n % len(block)]), cobj.flush()]
    return b"".join(parts)


def add_shard(cache: Path, unit: int, samples: Sequence[EncodedSample]) -> None:
    """Commit a new shard of `samples` into `cache` and list it in the manifest (checksums all valid)."""
    manifest = load_manifest(cache)
    h = manifest.hidden_size
    meta = ShardMeta(codec=manifest.codec, layers=manifest.layers, hidden_size=h, dtype=manifest.dtype)
    with ShardWriter(cache / "shards" / f"shard-{unit:06d}.dfs", meta) as writer:
        for sample in samples:
            writer.append(sample)
        manifest.shards.append(writer.commit())
    save_manifest(cache, manifest)


def bomb_sample(cache: Path, row: int, tokens: int) -> EncodedSample:
    """A sample claiming `tokens` tokens of zeros (token id 0, every token supervised): a few KB stored, `tokens` x hidden x layers x 2 bytes once decoded, every checksum valid."""
    manifest = load_manifest(cache)
    h = manifest.hidden_size
    plane = zstd_zeros(tokens * h)
    layer = len(plane).to_bytes(4, "little") * 2 + plane + plane  # lossless: two zstd byte planes
    frames = [zstd_zeros(4 * tokens), zstd_zeros(tokens, 1), *([layer] * len(manifest.layers))]
    return EncodedSample(
        row=row,
        length=tokens,
        supervised=tokens,
        dtype=manifest.dtype,
        hidden_size=h,
        codec=manifest.codec,
        frames=frames,
        checksums=[checksum(f) for f in frames],
    )


def run_measured(argv: Sequence[str], cwd: Path | None = None, timeout: float = 120) -> tuple[int, str, int]:
    """Run `python -m <argv>` in a child process: (exit code, stderr, peak RSS in MB of that child only)."""
    proc = subprocess.Popen(
        [sys.executable, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=cwd, text=True
    )
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    # communicate() reaped it; ru_maxrss of RUSAGE_CHILDREN would mix in every earlier child, so the
    # child reports its own peak on stderr's last line (see RSS_WRAPPER).
    lines = err.strip().splitlines()
    rss = int(lines[-1].removeprefix("RSS ")) // 1024 if lines and lines[-1].startswith("RSS ") else -1
    return proc.returncode, "\n".join(lines[:-1]) if rss >= 0 else err, rss


def cli(module: str, *args: str) -> list[str]:
    """argv for `run_measured`: `module.main(args)` that prints its own peak RSS (KB) last on stderr."""
    # VmHWM, not getrusage's ru_maxrss: Linux carries the peak of the pre-exec memory (the forking pytest
    # worker's copy, ~1 GB late in a full run) into ru_maxrss across execve; VmHWM is this program's own.
    code = (
        f"import re, sys; from {module} import main; rc = main(sys.argv[1:]); "
        "hwm = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1); "
        "print('RSS', hwm, file=sys.stderr); sys.exit(rc)"
    )
    return ["-c", code, *args]


def one_error_line(err: str, prog: str) -> str:
    """The single `prog: error: ...` line of a refused command (asserts there is nothing else but
    progress bars, which a terminal overwrites)."""
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip() and "%|" not in line]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err[-2000:]
    return lines[0]


def tree_snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under root (dotfiles included) with its bytes (None for directories and links)."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = p.read_bytes() if p.is_file() and not p.is_symlink() else None
    return out
