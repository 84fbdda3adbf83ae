"""A training run's directory under pressure (issue 31): two trainers on one `--out` (one is refused, naming
the holder; the run is one run's), a full disk while saving a checkpoint (one line, the committed checkpoints
intact), a damaged newest checkpoint (the refusal names the older intact one and `--resume-from`), and the
permissions of what a run publishes (the umask's, as for any other file)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from common.fake_cache import write_fake_cache
from common.hostile import one_error_line, tree_snapshot
from common.train_cli import tiny_train_argv
from dflash.shards import tensor_io
from dflash.shards.tensor_io import new_file_mode
from dflash.train import checkpoint as ckpt
from dflash.train import cli as train_cli
from dflash.train import export
from safetensors import SafetensorError
from safetensors.torch import load_file

PROG = "dflash-train"
QUIET = ("--no-tensorboard", "--no-plots", "--no-progress")
TRAIN = "import sys; from dflash.train.cli import main; sys.exit(main(sys.argv[1:]))"
HOLD = (
    "import sys; from pathlib import Path; from dflash.shards.locks import take_lock; "
    "take_lock(Path(sys.argv[1]), 'busy', command='dflash-train'); print('held', flush=True); sys.stdin.read()"
)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fake_cache(tmp_path_factory.mktemp("t") / "cache", num_samples=60, samples_per_shard=10)


@pytest.fixture(scope="module")
def run_template(template: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four steps, a checkpoint every two (step_000002, step_000004), no evaluation."""
    out = tmp_path_factory.mktemp("run") / "run"
    argv = tiny_train_argv(
        template, out, "--max-steps", "4", "--save-every", "2", "--eval-every", "0", *QUIET
    )
    assert train_cli.main(argv) == 0
    return out


@pytest.fixture
def run(run_template: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_template, tmp_path / "run"))


def _seeds(run: Path) -> set[int]:
    """The seed of every record the run directory holds: its config.json and each checkpoint's meta.json."""
    seeds = {json.loads((run / "config.json").read_text())["seed"]}
    for meta in [*run.glob("checkpoints/step_*/meta.json"), *run.glob("best/meta.json")]:
        seeds.add(json.loads(meta.read_text())["config"]["seed"])
    return seeds


# --- two trainers, one --out ---------------------------------------------------------------------------------


def test_two_trainers_started_together_one_refused_run_unmixed(template: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    flags = ("--save-every", "3", "--eval-every", "5", *QUIET)
    procs = {
        seed: subprocess.Popen(
            [sys.executable, "-c", TRAIN, *tiny_train_argv(template, out, "--seed", str(seed), *flags)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    }
    results = {seed: (p.communicate(timeout=300)[1], p.returncode) for seed, p in procs.items()}
    assert sorted(rc for _, rc in results.values()) == [0, 2], results
    winner = next(seed for seed, (_, rc) in results.items() if rc == 0)
    line = one_error_line(next(err for err, rc in results.values() if rc == 2), PROG)
    # Started together, the second finds the lock held or, if the first already finished, its checkpoints:
    # never both training (the old code let both write one directory, and exit 0).
    assert "being written by another dflash-train (pid " in line or "already holds checkpoints" in line, line
    assert len(list(out.glob("checkpoints/step_*"))) >= 2 and (out / "export" / "model.safetensors").is_file()
    assert _seeds(out) == {winner}


@pytest.fixture
def holder(tmp_path: Path):
    """`start(run)`: a process holding `RUN/.lock` as a running trainer would, until the test ends."""
    procs = []

    def start(run: Path) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(run / ".lock")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_trainer_and_resume_refused_while_a_trainer_holds_the_run(
    run: Path, template: Path, holder, capsys
) -> None:
    proc = holder(run)
    before = tree_snapshot(run / "checkpoints")
    for extra in (
        ("--seed", "2"),
        ("--resume",),
        ("--resume", "--max-steps", "6"),
        ("--resume", "--dry-run"),
    ):
        argv = tiny_train_argv(
            template, run, "--max-steps", "4", "--save-every", "2", "--eval-every", "0", *extra, *QUIET
        )
        assert train_cli.main(argv) == 2
        line = one_error_line(capsys.readouterr().err, PROG)
        assert f"{run} is being written by another dflash-train (pid {proc.pid} on " in line, line
        assert "command dflash-train" in line and "choose another --out" in line
    assert tree_snapshot(run / "checkpoints") == before
    # The holder dies without releasing anything: its lock file stays, and blocks nothing.
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (run / ".lock").exists()
    argv = tiny_train_argv(
        template, run, "--max-steps", "6", "--save-every", "2", "--eval-every", "0", "--resume", *QUIET
    )
    assert train_cli.main(argv) == 0
    assert (run / "checkpoints" / "step_000006").is_dir()


# --- a full disk while saving a checkpoint -------------------------------------------------------------------


def _no_space_in_safetensors(*args, **kwargs):
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def _no_space_in_json(path: Path, obj) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@pytest.mark.parametrize("where", ["safetensors", "json"])
def test_disk_full_while_saving_is_one_line_and_keeps_checkpoints(
    run: Path, template: Path, capsys, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    before = tree_snapshot(run / "checkpoints")
    if where == "safetensors":  # what safetensors raises when the disk fills (its own Rust I/O error)
        monkeypatch.setattr(tensor_io, "save_file", _no_space_in_safetensors)
    else:
        monkeypatch.setattr(ckpt, "_write_json", _no_space_in_json)
    argv = tiny_train_argv(
        template, run, "--max-steps", "6", "--save-every", "2", "--eval-every", "0", "--resume", *QUIET
    )
    assert train_cli.main(argv) == 2
    line = one_error_line(capsys.readouterr().err, PROG)
    assert "step_000006: no space left on device while writing this checkpoint" in line, line
    assert "step_000002, step_000004" in line and "--resume" in line
    assert tree_snapshot(run / "checkpoints") == before  # nothing committed lost, no temp left behind
    monkeypatch.undo()
    assert train_cli.main(argv) == 0  # space freed: the same command continues
    assert (run / "checkpoints" / "step_000006").is_dir()


def test_disk_full_while_exporting_the_best_says_resume(
    template: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(tensors, path, metadata=None) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(export, "save_tensors", full)
    out = tmp_path / "run"
    argv = tiny_train_argv(
        template, out, "--max-steps", "4", "--save-every", "2", "--eval-every", "2", *QUIET
    )
    assert train_cli.main(argv) == 2
    line = one_error_line(capsys.readouterr().err, PROG)
    assert "model.safetensors" in line and "no space left on device" in line and "--resume" in line, line
    assert not (out / "export" / "model.safetensors").exists()


# --- a damaged newest checkpoint ---------------------------------------------------------------------------------


def test_damaged_newest_checkpoint_names_the_older_intact_one(run: Path, template: Path, capsys) -> None:
    newest = run / "checkpoints" / "step_000004"
    # Copied out: load_file maps the file, and the damage below rewrites it in place.
    reference = {k: v.clone() for k, v in load_file(newest / "model.safetensors").items()}
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # a torn copy
    base = tiny_train_argv(
        template, run, "--max-steps", "4", "--save-every", "2", "--eval-every", "0", *QUIET
    )
    assert train_cli.main([*base, "--resume"]) == 2
    line = one_error_line(capsys.readouterr().err, PROG)
    older = run / "checkpoints" / "step_000002"
    assert str(weights) in line and f"--resume-from {older}" in line, line
    assert train_cli.main([*base, "--resume-from", str(older)]) == 0
    # The resumed run rewrote step 4 exactly as the uninterrupted run had (CPU: bit-identical).
    again = load_file(newest / "model.safetensors")
    assert again.keys() == reference.keys() and all(again[k].equal(reference[k]) for k in reference)


def test_resume_from_elsewhere_is_refused(run: Path, run_template: Path, template: Path, capsys) -> None:
    base = tiny_train_argv(template, run, "--max-steps", "6", "--eval-every", "0", *QUIET)
    other = run_template / "checkpoints" / "step_000002"  # another run's checkpoint: never mixed in
    assert train_cli.main([*base, "--resume-from", str(other)]) == 2
    line = one_error_line(capsys.readouterr().err, PROG)
    assert (
        f"--resume-from {other} is not a checkpoint of {run}" in line and "step_000002, step_000004" in line
    )


def test_every_checkpoint_damaged_says_so(run: Path, template: Path, capsys) -> None:
    for step in ("step_000002", "step_000004"):
        (run / "checkpoints" / step / "rng.json").write_text("{")
    assert train_cli.main(tiny_train_argv(template, run, "--resume", "--max-steps", "6", *QUIET)) == 2
    line = one_error_line(capsys.readouterr().err, PROG)
    assert "step_000004" in line and "no older checkpoint is intact" in line, line


# --- what a run publishes is readable as any file is -------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_published_files_have_the_umasks_mode(template: Path, tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        out = tmp_path / "run"
        argv = tiny_train_argv(
            template, out, "--max-steps", "2", "--save-every", "2", "--eval-every", "2", *QUIET
        )
        assert train_cli.main(argv) == 0
        assert train_cli.main(["export", str(out), "--out", str(tmp_path / "drafter")]) == 0
        expected = new_file_mode()
        assert expected == 0o666 & ~umask
        files = [
            out / "config.json",
            out / "metrics.jsonl",
            *out.glob("checkpoints/*/*"),
            *out.glob("best/*"),
            *out.glob("export/*"),
            *(tmp_path / "drafter").glob("*"),
        ]
        names = {p.name for p in files}
        assert names >= {"model.safetensors", "optimizer.safetensors", "rng.safetensors", "dflash.py"}
        modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in files}
        assert set(modes.values()) == {oct(expected)}, modes
    finally:
        os.umask(old)
