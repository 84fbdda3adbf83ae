"""The quality benchmark's phases, each kept in its work folder and skipped when its output exists (a cut-off
benchmark resumes where it stopped): the target LM, its greedy rows, one cache per codec through the real
`dflash-extract`, and one drafter per run through the real `dflash-train` (`bench/bench_quality.py` runs them)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from dflash.shards.atomic import atomic_write_json
from dflash.shards.codecs import codec_names
from dflash.train.checkpoint import latest_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.quality_data import cut_prompts, greedy_continuations, read_corpus, write_rows
from bench.quality_pack import TRITON_CACHE, target_done
from bench.quality_prose import ASSISTANT, CHAT_TOKENS, cut_chat_prompts, read_prose_corpus
from bench.quality_sizes import (
    CHECKPOINTS_PER_RUN,
    DEFAULTS_CURVE_EVERY,
    DEFAULTS_SAVE_EVERY,
    OLD_ORDER,
    Run,
    Size,
)
from bench.quality_target import PAD, build_tokenizer, tokenize_files, train_target


def _python(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


# The extractions and runs in flight: the runs' threads wait on them, so a signal to the benchmark (its main
# thread) reaches them only through `stop_children`.
_children: set[subprocess.Popen] = set()
_children_lock = threading.RLock()  # the handler runs on the main thread, which may hold it


def stop_children_on_signals() -> None:
    """SIGTERM or SIGHUP to the benchmark first passes SIGTERM to each `dflash-extract` / `dflash-train` it
    runs (a run checkpoints at its step and exits; an extraction keeps its committed shards), then ends the
    benchmark: killed alone it would leave them running, writing into the work folder."""

    def stop(signum: int, _frame: object) -> None:
        with _children_lock:
            for child in _children:
                child.terminate()
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def _call(cmd: list[str], log: Path, env: dict[str, str] | None = None, append: bool = False) -> float:
    start = time.perf_counter()
    with log.open("a" if append else "w") as f:
        child = subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        with _children_lock:
            _children.add(child)
        try:
            returncode = child.wait()
        finally:
            with _children_lock:
                _children.discard(child)
    if returncode:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"{' '.join(cmd[2:4])} failed (exit {returncode}); {log}:\n  " + "\n  ".join(tail))
    return time.perf_counter() - start


def phase_target(work: Path, size: Size, device: str, seed: int) -> tuple[dict[str, Any], Any, list, list]:
    """Tokenizer + target LM (trained once), and the tokenized train / held-out files (kept as .npy)."""
    from transformers import AutoTokenizer

    target, tokens = work / "target", work / "tokens"
    done = target_done(work)
    if done.is_file() and (work / "data" / "rows.json").is_file():  # nothing left that needs the corpus
        return json.loads(done.read_text()), None, [], []
    if (tokens / "corpus.json").is_file():
        corpus = json.loads((tokens / "corpus.json").read_text())
        tokenizer = AutoTokenizer.from_pretrained(str(target))
        train_files, held_files = (
            _load_files(tokens / f"{split}.npy", corpus[split]) for split in ("train", "heldout")
        )
    else:
        prose = size.target.kind == "prose"
        read = read_prose_corpus if prose else read_corpus
        train_texts, held_texts, corpus = read(int(size.target.corpus_mb * 2**20), seed)
        target.mkdir(parents=True, exist_ok=True)
        if (target / "tokenizer.json").is_file():
            tokenizer = AutoTokenizer.from_pretrained(str(target))
        else:
            tokenizer = build_tokenizer(train_texts, size.target.vocab, target, int(size.target.bpe_mb * 2**20),
                                        CHAT_TOKENS if prose else ())  # fmt: skip
        train_files, held_files = (
            tokenize_files(tokenizer, train_texts),
            tokenize_files(tokenizer, held_texts),
        )
        tokens.mkdir(exist_ok=True)
        for split, files in (("train", train_files), ("heldout", held_files)):
            np.save(tokens / f"{split}.npy", np.concatenate(files), allow_pickle=False)
            corpus[split] = [len(f) for f in files]
        (tokens / "corpus.json").write_text(json.dumps(corpus))
    if done.is_file():
        info = json.loads(done.read_text())
    else:
        info = train_target(size.target, tokenizer, train_files, target, device, seed)
    info["corpus"] = {"files": corpus["files"], "bytes": corpus["bytes"], "train_tokens": sum(corpus["train"]),
                      "heldout_tokens": sum(corpus["heldout"]), "sha256": corpus.get("sha256")}  # fmt: skip
    done.write_text(json.dumps(info, indent=1) + "\n")  # later calls need neither the corpus nor its tokens
    return info, tokenizer, train_files, held_files


def _load_files(path: Path, lengths: list[int]) -> list[np.ndarray]:
    flat = np.load(path, allow_pickle=False)
    return np.split(flat, np.cumsum(lengths)[:-1])


def phase_data(work: Path, size: Size, tokenizer: Any, train_files: list, held_files: list, device: str,
               seed: int) -> dict[str, Any]:  # fmt: skip
    data = work / "data"
    rows_path, meta_path = data / "rows.arrow", data / "rows.json"
    if meta_path.is_file():
        return json.loads(meta_path.read_text())
    rng = np.random.default_rng(seed + 1)
    spec = size.data
    cut = cut_prompts
    if size.target.kind == "prose":  # a user turn and the beginning of its answer
        header = np.asarray(tokenizer(ASSISTANT, add_special_tokens=False)["input_ids"], dtype=np.int32)
        cut = partial(cut_chat_prompts, header=header)
    prompts = cut(train_files, spec.train_rows, spec, rng=rng) + cut(
        held_files, spec.eval_rows, spec, rng=rng
    )
    start = time.perf_counter()
    answers = greedy_continuations(
        work / "target", prompts, spec, tokenizer.convert_tokens_to_ids(PAD), device
    )
    seconds = time.perf_counter() - start
    write_rows(rows_path, prompts, answers)
    meta = {
        "rows": len(prompts),
        "train_rows": spec.train_rows,
        "eval_rows": list(range(spec.train_rows, spec.train_rows + spec.eval_rows)),
        "tokens": int(sum(len(p) + len(a) for p, a in zip(prompts, answers, strict=True))),
        "generate_seconds": round(seconds, 1),
        "gen_batch": spec.gen_batch,  # the rows depend on it
        "rows_sha256": hashlib.sha256(rows_path.read_bytes()).hexdigest(),  # whether two machines' rows agree
    }
    meta_path.write_text(json.dumps(meta) + "\n")
    return meta


def cache_complete(work: Path, codec: str) -> bool:
    """Whether the work folder's cache of `codec` is complete (its manifest, written last, says so)."""
    manifest = work / f"cache-{codec}" / "manifest.json"
    return manifest.is_file() and bool(json.loads(manifest.read_text()).get("complete"))


def unmade_caches(work: Path, codecs: list[str]) -> list[str]:
    """The names among `codecs` that are no dflash codec and have no complete cache of that name to train on:
    a cache a codec's simulation wrote (`bench/simulate_codec.py --out W/cache-NAME`) trains under its own name,
    but nothing can extract one."""
    return [c for c in codecs if c not in codec_names() and not cache_complete(work, c)]


def phase_cache(work: Path, codec: str, device: str, token_budget: int) -> Path:
    """The cache of one codec, extracted from the target by the real `dflash-extract` CLI."""
    cache = work / f"cache-{codec}"
    if cache_complete(work, codec):
        return cache
    cmd = _python("dflash.extract.cli", "--target", str(work / "target"), "--dataset", str(work / "data" / "rows.arrow"),
                  "--out", str(cache), "--codec", codec, "--layers", "all", "--device", device, "--no-compile",
                  "--token-budget", str(token_budget))  # fmt: skip
    if device == "cpu":
        cmd += ["--dtype", "float32"]
    # in the work folder, so `--pack` carries it to the next machine (quality_pack.TRITON_CACHE says why)
    _call(cmd, work / f"cache-{codec}.log", env={"TRITON_CACHE_DIR": str(work / TRITON_CACHE)})
    return cache


def extraction_summary(work: Path, codec: str) -> list[str]:
    """The end of a codec's `dflash-extract` log: its throughput and each stage's busy and waiting time (kept in
    the report, so that a device call's report tells where a slow extraction spent its time), the work folder
    written `W` (a report is committed: no machine's paths in it)."""
    log = work / f"cache-{codec}.log"
    if not log.is_file():
        return []
    lines = log.read_text(errors="replace").replace(str(work), "W").splitlines()
    done = [i for i, line in enumerate(lines) if line.startswith("cache ") and ": complete" in line]
    return lines[done[-1] :][:20] if done else lines[-12:]


def run_flags(
    run: Run, work: Path, size: Size, meta: dict[str, Any], device: str, extra: list[str]
) -> list[str]:
    """The `dflash-train` command line of one run. Held-out rows = evaluation rows, plus the training rows a
    fraction leaves out (held-out rows never train)."""
    eval_rows = meta["eval_rows"]
    rows_file = heldout_file(run.dir.parent, run.fraction)
    recipe = size.drafter
    # Every run evaluates at its end too, so a call cut off before its `Scorer` turn still has each tau.
    if recipe.steps is None:  # its epochs set the length; dflash-train evaluates at its last step anyway
        # every run evaluates along the way, curve or not: on the defaults --early-stop reads the evaluations
        eval_every = DEFAULTS_CURVE_EVERY
        save_every = DEFAULTS_SAVE_EVERY
    else:
        eval_every = max(1, recipe.steps // recipe.eval_points) if run.curve else recipe.steps
        save_every = max(1, recipe.steps // CHECKPOINTS_PER_RUN)
    return [
        "--cache", str(work / f"cache-{run.codec}"), "--out", str(run.dir), "--seed", str(run.seed),
        "--device", device, "--eval-rows", str(rows_file), "--eval-fraction", "0",
        "--eval-samples", str(len(eval_rows)), "--eval-every", str(eval_every), "--save-every", str(save_every),
        "--log-every", "50", "--no-tensorboard", "--no-plots", "--no-progress",
        *recipe.flags(), *extra, *run.flags,
    ]  # fmt: skip


def command_file(root: Path, name: str) -> Path:
    """Where a run's `dflash-train` flags are kept (a JSON list)."""
    return root / f"{name}.cmd.json"


def heldout_file(root: Path, fraction: float) -> Path:
    return root / f"heldout-{fraction:g}.json"


def write_heldout_files(root: Path, meta: dict[str, Any], fractions: tuple[float, ...]) -> None:
    """Per training-row fraction, the rows no run of it trains on: the evaluation rows plus the training rows
    the fraction leaves out. Written once, before runs that read them start side by side."""
    root.mkdir(parents=True, exist_ok=True)
    for fraction in fractions:
        keep = round(fraction * meta["train_rows"])
        heldout = sorted(set(meta["eval_rows"]) | set(range(keep, meta["train_rows"])))
        heldout_file(root, fraction).write_text(json.dumps(heldout))


def train_and_export(flags: list[str], run_dir: Path, name: str, resume: bool = False) -> float:
    """`dflash-train FLAGS` (its `--out` is `run_dir`; with `--resume` when `resume`), then its export to
    RUN/final; logged in the runs folder as NAME.log (a resumed attempt's appended) and NAME-export.log, FLAGS
    kept as NAME.cmd.json (so a cut run, or `bench/quality_resume.py`, can go on from the run as a user
    would). Returns the training's seconds (this attempt's)."""
    runs = run_dir.parent
    atomic_write_json(command_file(runs, name), flags)  # read back to tell a cut run's command
    command = [*flags, "--resume"] if resume else flags
    seconds = _call(_python("dflash.train.cli", *command), runs / f"{name}.log", append=resume)
    _call(_python("dflash.train.cli", "export", str(run_dir), "--out", str(run_dir / "final")),
          runs / f"{name}-export.log")  # fmt: skip
    return seconds


def cut_run_checkpoint(run: Run, flags: list[str]) -> Path | None:
    """The last checkpoint of a run cut off earlier (a device call's limit) with these same flags, if any."""
    cmd = command_file(run.dir.parent, run.name)
    if not run.dir.is_dir() or not cmd.is_file() or json.loads(cmd.read_text()) != flags:
        return None
    return latest_checkpoint(run.dir)


def phase_run(run: Run, work: Path, size: Size, meta: dict[str, Any], device: str, extra: list[str]) -> Run:
    seconds_file = run.dir / "bench_seconds.json"  # written once the run is trained and exported
    if not seconds_file.is_file():
        flags = run_flags(run, work, size, meta, device, extra)
        resume_at = cut_run_checkpoint(run, flags)
        if resume_at is not None:  # goes on as `dflash-train` tells a user to: the same command, --resume
            print(f"[run] {run.name} goes on from {resume_at.name}", flush=True)
            run.result["resumed_from"] = resume_at.name
        elif run.dir.exists():  # cut off before its first checkpoint, or another command's: start again
            shutil.rmtree(run.dir)
        run.dir.parent.mkdir(parents=True, exist_ok=True)
        seconds = train_and_export(flags, run.dir, run.name, resume=resume_at is not None)
        atomic_write_json(seconds_file, {"train_seconds": round(seconds, 1)})  # the run's "finished" mark
    run.result["train_seconds"] = json.loads(seconds_file.read_text())["train_seconds"]
    # the epoch order it trained on (dflash-train writes RUN/config.json; runs from before spans have none)
    run.result["data_order"] = json.loads((run.dir / "config.json").read_text()).get("data_order", OLD_ORDER)
    run.result["curve"] = [
        {k: r[k] for k in ("step", "tau", "tau_walk", "eval_loss") if k in r}
        for r in map(json.loads, (run.dir / "metrics.jsonl").read_text().splitlines())
        if "tau" in r
    ]
    return run
