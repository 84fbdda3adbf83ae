"""`bench/device_job.sh`: a device session's work as one detached job, and the calls that follow it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from bench import quality_merge
from bench.quality_gaps import codec_gaps, variant_gaps

SCRIPT = Path(__file__).parents[1] / "bench" / "device_job.sh"


def _sh(*args: str, dest: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "POLL_EVERY": "0.2"}
    env.pop("OUT", None)
    argv = ["bash", str(SCRIPT), *args] + ([str(dest)] if dest else [])
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env)


def test_poll_ends_at_once_on_a_machine_that_did_not_start_the_job(tmp_path: Path) -> None:
    done = _sh("poll", str(tmp_path / "q"), "300", dest=tmp_path / "out")
    assert done.returncode == 3 and "did not start the job" in done.stderr
    assert not (tmp_path / "out").exists()


def test_a_started_job_runs_detached_and_poll_brings_back_its_reports_and_logs(tmp_path: Path) -> None:
    work, out = tmp_path / "q", tmp_path / "out"
    job = tmp_path / "job.sh"
    job.write_text(
        'W=$1\necho "== build"\nmkdir -p $W/code/runs/base-q4-f1-s2\n'
        'echo \'{"step": 3918, "loss": 0.7}\' > $W/code/runs/base-q4-f1-s2/metrics.jsonl\n'
        "echo '{\"runs\": []}' > $W/code-s2.json\necho table > $W/codecs.txt\n"
        'printf "[extract q4] 90 s\\n" > $W/code-s2.log\necho "== train"\nexit 4\n'
    )
    started = _sh("start", str(work), str(job))
    assert started.returncode == 0 and "started" in started.stdout
    done = _sh("poll", str(work), "20", dest=out)
    assert done.returncode == 0, done.stderr
    assert "== exit 4" in done.stdout  # the job's own status, in its log's last step line
    assert 'base-q4-f1-s2: "step": 3918' in done.stdout
    assert (out / "code-s2.json").read_text() == '{"runs": []}\n'
    assert (out / "codecs.txt").read_text() == "table\n"
    assert "== code-s2.log\n[extract q4] 90 s" in (out / "logs.tail").read_text()
    assert (out / "job.log").read_text().splitlines() == ["== build", "== train", "== exit 4"]


def test_poll_stops_after_its_seconds_while_the_job_runs_on(tmp_path: Path) -> None:
    work = tmp_path / "q"
    job = tmp_path / "job.sh"
    job.write_text('echo "== sleeping"\nsleep 30\n')
    assert _sh("start", str(work), str(job)).returncode == 0
    try:
        done = _sh("poll", str(work), "2")
        assert done.returncode == 0 and "== sleeping" in done.stdout and "== exit" not in done.stdout
    finally:
        subprocess.run(["pkill", "-f", str(job)], check=False)


def _cpu_job(tmp_path: Path, *job: str, name: str = "q", **env_vars: str) -> Path:
    """`device_job.sh start` of a bench/jobs/ job at the CI size on this CPU, polled to its end: what came back."""
    work, out = tmp_path / name, tmp_path / f"{name}-out"
    env = {**os.environ, "SIZE": "ci", "DEVICE": "cpu", "RECIPE": "size", "OMP_NUM_THREADS": "1", **env_vars}
    env["DEVICE_ENV_NO_WHEELS"] = "1"
    start = ["bash", str(SCRIPT), "start", str(work), *job]
    subprocess.run(start, cwd=SCRIPT.parents[1], env=env, check=True, capture_output=True, timeout=30)
    poll = ["bash", str(SCRIPT), "poll", str(work), "600", str(out)]
    subprocess.run(poll, env={**env, "POLL_EVERY": "1"}, check=True, capture_output=True, timeout=660)
    assert (out / "job.log").read_text().splitlines()[-1] == "== exit 0"
    return out


def test_the_seeds_job_extracts_each_cache_once_and_reports_every_seed_and_distilled_run(
    tmp_path: Path,
) -> None:
    # bench/jobs/seeds.sh: the steps a device session runs, end to end
    out = _cpu_job(tmp_path, "bench/jobs/seeds.sh", "prose", "0 1", "distill", PACK="1")
    reports = {p.name: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(reports) == [
        "prose-s0-distill.json",
        "prose-s0.json",
        "prose-s1-distill.json",
        "prose-s1.json",
    ]
    assert sorted(r["run"] for r in reports["prose-s1.json"]["runs"]) == [
        "base-fp8-f1-s1", "base-lossless-f1-s1", "base-q4-f1-s1"
    ]  # fmt: skip
    assert [r["run"] for r in reports["prose-s0-distill.json"]["runs"]] == ["distill-lossless-f1-s0"]
    # every run evaluated along the way: a job cut before its end would still have brought back each pair
    curves = (out / "curves.txt").read_text().splitlines()
    for pair in ("q4 vs lossless (base)", "fp8 vs lossless (base)", "distill vs base (lossless)"):
        # one line a step, each seed's gap on it
        assert any(f"{pair}, seeds s0 " in line and ", s1 " in line for line in curves), curves
    # the first seed's process extracted the three caches; every other one found them complete
    for name, report in reports.items():
        # (a dflash-extract run starts a python with torch: seconds; a complete cache is taken at once)
        extracted = {k: v for k, v in report["seconds"].items() if k.startswith("extract")}
        if name == "prose-s0.json":
            assert len(extracted) == 3 and all(v >= 1 for v in extracted.values()), extracted
        else:
            assert extracted and all(v < 1 for v in extracted.values()), (name, extracted)
    # PACK=1: the built target and rows came back; a later job (a fresh machine) starts from them, builds nothing
    parts = sorted(p.name for p in (out / "pack").iterdir())
    assert parts and all(p.startswith("quality-work-prose.") for p in parts), parts
    # (CODECS: a session short of device time trains fewer codecs a seed, and waits for no cache it does not use)
    pack, codecs = str(out / "pack"), "lossless,q4"
    again = _cpu_job(tmp_path, "bench/jobs/seeds.sh", "prose", "2", name="again", UNPACK=pack, CODECS=codecs)
    assert "unpacked target/ and data/" in (tmp_path / "again" / "build.log").read_text()
    (later,) = [json.loads(p.read_text()) for p in again.glob("*.json")]
    assert sorted(r["run"] for r in later["runs"]) == ["base-lossless-f1-s2", "base-q4-f1-s2"]
    assert not list((tmp_path / "again").glob("**/cache-fp8"))
    for part in ("target", "data"):
        assert later[part] == reports["prose-s0.json"][part]  # the same weights, corpus and rows' digests
    # bench/jobs/epochs.sh from the same pack (another session): a longer schedule's seeds on two codecs, paired
    # with the defaults' runs of the same seeds by the merge
    longer = _cpu_job(
        tmp_path, "bench/jobs/epochs.sh", "prose", "3", "2", "1", name="longer", UNPACK=pack, CODECS=codecs
    )
    (report,) = [json.loads(p.read_text()) for p in longer.glob("*.json")]
    assert sorted(r["run"] for r in report["runs"]) == ["e3-lossless-f1-s2", "e3-q4-f1-s2"]
    assert all("--epochs 3" in " ".join(r["flags"]) for r in report["runs"])
    paths = [again / "prose-s2.json", longer / "prose-e3.json"]
    merged = quality_merge.merge({p: quality_merge.read_report(p) for p in paths})
    gaps = variant_gaps(merged["runs"])
    assert sorted((g["variant"], g["codec"], g["reference"], g["seeds"]) for g in gaps) == [
        ("e3", "lossless", "base", ["s2"]), ("e3", "q4", "base", ["s2"])
    ]  # fmt: skip


def test_the_layer_delta_job_trains_q4_and_its_simulated_delta_beside_lossless_from_a_packed_build(
    tmp_path: Path,
) -> None:
    # bench/jobs/pack.sh: a session's spare device time spent on the build alone; its parts come back, no report
    packed = _cpu_job(tmp_path, "bench/jobs/pack.sh", "code", name="pack")
    assert not list(packed.glob("*.json")) and [p.name for p in (packed / "pack").iterdir()]
    # bench/jobs/layer_delta.sh from that pack (a fresh machine): builds nothing; one report, the simulated cache
    # trained under its own name, paired with lossless
    out = _cpu_job(tmp_path, "bench/jobs/layer_delta.sh", "code", "1", UNPACK=str(packed / "pack"))
    assert "unpacked target/ and data/" in (tmp_path / "q" / "build.log").read_text()
    assert sorted(p.name for p in out.glob("*.json")) == ["code-s1-q4delta.json"]
    report = json.loads((out / "code-s1-q4delta.json").read_text())
    assert sorted(r["run"] for r in report["runs"]) == [
        "base-lossless-f1-s1",
        "base-q4-f1-s1",
        "base-q4delta-f1-s1",
    ]
    assert sorted(g["codec"] for g in codec_gaps(report["runs"])) == ["q4", "q4delta"]
    # a later session's codec alone (CODECS=fp8) from the same pack: extracts lossless only to score on, trains
    # fp8 alone, and the merge pairs it with the lossless run above (same rows and batches)
    alone = _cpu_job(
        tmp_path, "bench/jobs/seeds.sh", "code", "1", name="fp8", UNPACK=str(packed / "pack"), CODECS="fp8"
    )
    (later,) = [json.loads(p.read_text()) for p in alone.glob("*.json")]
    assert [r["run"] for r in later["runs"]] == ["base-fp8-f1-s1"] and later["scored_on"] == "lossless"
    paths = [out / "code-s1-q4delta.json", alone / "code-s1.json"]
    merged = quality_merge.merge({p: quality_merge.read_report(p) for p in paths})
    assert sorted((g["codec"], tuple(g["seeds"])) for g in codec_gaps(merged["runs"])) == [
        ("fp8", ("s1",)), ("q4", ("s1",)), ("q4delta", ("s1",))
    ]  # fmt: skip


def test_await_cache_fails_once_the_process_making_the_cache_has_ended(tmp_path: Path) -> None:
    # a first extraction that fails must not leave the job waiting out the device session
    script = SCRIPT.parent / "jobs" / "await_cache.sh"
    gone = subprocess.Popen(["true"])
    gone.wait()
    env = {**os.environ, "AWAIT_EVERY": "0.1"}
    done = subprocess.run(["bash", str(script), str(tmp_path / "c"), str(gone.pid)], capture_output=True,
                          text=True, timeout=20, env=env)  # fmt: skip
    assert done.returncode == 1 and "has ended" in done.stderr
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "manifest.json").write_text('{"complete": true}')
    done = subprocess.run(["bash", str(script), str(tmp_path / "c"), str(gone.pid)], timeout=20, env=env)
    assert done.returncode == 0  # complete: the process's end does not matter
