"""`bench/bench_quality.py --size ci`: every phase through the real CLIs (target LM -> greedy data -> extract
-> train -> export -> evaluation on held-out files) on a CPU in seconds. Checks the benchmark, not the drafter."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from bench import bench_quality, quality_data, quality_phases, quality_sizes, quality_target
from bench.quality_report import SPLIT_CLASSES, print_split_table, print_table


@pytest.mark.slow
def _ci_argv(work: Path, *flags: str) -> list[str]:
    """bench_quality's command line at the ci size on this CPU, in `work`."""
    return ["--size", "ci", "--device", "cpu", "--work", str(work), *flags]


def test_ci_size_runs_every_phase_and_reports_on_heldout_rows(tmp_path: Path, capsys) -> None:
    work = tmp_path / "q"
    assert bench_quality.main(["--size", "ci", "--device", "cpu", "--work", str(work)]) == 0
    report = json.loads((work / "runs" / "quality.json").read_text())
    size = bench_quality.SIZES["ci"]
    meta = json.loads((work / "data" / "rows.json").read_text())
    assert meta["rows_sha256"] == hashlib.sha256((work / "data" / "rows.arrow").read_bytes()).hexdigest()
    # Evaluation rows come after the training rows and are held out of every run.
    assert meta["eval_rows"] == list(range(size.data.train_rows, size.data.train_rows + size.data.eval_rows))
    for fraction in size.fractions:
        heldout = set(json.loads((work / "runs" / f"heldout-{fraction:g}.json").read_text()))
        assert set(meta["eval_rows"]) <= heldout
        assert len(heldout) == size.data.eval_rows + size.data.train_rows - round(
            fraction * size.data.train_rows
        )
    base = report["baselines"]
    b = size.drafter.block_size
    assert base["prompt_lookup"]["eval_samples"] == size.data.eval_rows
    assert 1.0 <= base["prompt_lookup"]["tau_walk"] <= b
    # Untrained: random logits over the vocabulary accept (almost) nothing.
    assert base["untrained"]["tau"] < 1.5
    names = {r["run"] for r in report["runs"]}
    assert names == {"base-lossless-f1-s0", "base-fp8-f1-s0", "base-q4-f1-s0", "base-lossless-f0.5-s0"}
    for run in report["runs"]:
        assert 1.0 <= run["tau"] <= b and 1.0 <= run["tau_walk"] <= b
        assert run["eval_samples"] == size.data.eval_rows
        # The recipe's loss decay reaches dflash-train (the paper's gamma is 4 for B = 8).
        trained = json.loads((work / "runs" / run["run"] / "config.json").read_text())
        assert trained["gamma"] == size.drafter.gamma == 2.0
    # One run draws the tau-vs-steps curve (the first codec's, all rows, first seed); the rest evaluate once.
    (curve,) = report["curves"]
    assert curve["run"] == "base-lossless-f1-s0" and [p["step"] for p in curve["points"]] == [6, 12]
    out = capsys.readouterr().out
    assert "walk/lookup" in out
    # Every run carries the drafter's split by what prompt lookup accepts, printed after the main table.
    for run in report["runs"] + [base["untrained"]]:
        assert sum(run[f"walk_split_{c}_share"] for c in SPLIT_CLASSES) == pytest.approx(1.0)
        assert 1.0 <= run["tau_walk_max"] <= b
    assert f"by what prompt lookup accepts of the block's {b - 1} tokens" in out
    # Every phase is reused on a second call: nothing is recomputed.
    before = {p: p.stat().st_mtime_ns for p in (work / "runs" / "base-lossless-f1-s0" / "final").iterdir()}
    assert bench_quality.main(["--size", "ci", "--device", "cpu", "--work", str(work)]) == 0
    assert {
        p: p.stat().st_mtime_ns for p in (work / "runs" / "base-lossless-f1-s0" / "final").iterdir()
    } == before


@pytest.mark.slow
def test_score_on_extracts_the_scoring_cache_without_training_on_it(tmp_path: Path, monkeypatch) -> None:
    opened: list[Path] = []

    class Recording(bench_quality.Scorer):
        def _open(self, config) -> None:
            super()._open(config)
            opened.append(Path(self.cache.path))

    monkeypatch.setattr(bench_quality, "Scorer", Recording)
    work = tmp_path / "q"
    argv = ["--size", "ci", "--device", "cpu", "--work", str(work), "--codecs", "q4", "--fractions", "1"]
    assert bench_quality.main([*argv, "--score-on", "lossless"]) == 0
    report = json.loads((work / "runs" / "quality.json").read_text())
    assert report["scored_on"] == "lossless" and [r["run"] for r in report["runs"]] == ["base-q4-f1-s0"]
    assert json.loads((work / "cache-lossless" / "manifest.json").read_text())["complete"]
    assert opened == [work / "cache-lossless"]  # the q4 drafter was scored on exact states


def test_deadline_starts_no_run_the_runs_so_far_say_would_not_end_in_time(tmp_path: Path, capsys) -> None:
    """A device call kills what still runs at its limit, losing the run and its device time: with --deadline
    the first run always starts (nothing to go by), a later one only if the longest so far would end in time.
    Here every run takes more than the whole deadline, so the second seed is reported as not started, its
    group's row says so, and the benchmark still succeeds on the run it finished."""
    assert quality_sizes.starts_in_time(10.0, []) and quality_sizes.starts_in_time(10.0, [4.0, 10.0])
    assert not quality_sizes.starts_in_time(9.9, [4.0, 10.0]) and not quality_sizes.starts_in_time(
        -1.0, [1.0]
    )
    work = tmp_path / "q"
    argv = _ci_argv(work, "--codecs", "lossless,fp8", "--fractions", "1")
    assert bench_quality.main([*argv, "--parallel", "1", "--deadline", "0.001"]) == 0
    report = json.loads((work / "runs" / "quality.json").read_text())
    done, skipped = report["runs"]
    assert done["run"] == "base-lossless-f1-s0" and "tau_walk" in done and "not_started" not in done
    assert (
        skipped["run"] == "base-fp8-f1-s0"
        and "tau" not in skipped
        and "left before --deadline" in skipped["not_started"]
    )
    assert not (work / "runs" / "base-fp8-f1-s0").exists()
    assert [row.get("not_started", False) for row in report["table"]] == [True, False]  # fp8 sorts first
    assert "base: fp8, 100% rows" in capsys.readouterr().out.split("not started (--deadline)")[0]


def test_first_seed_adds_seeds_to_an_earlier_experiment(tmp_path: Path) -> None:
    # `--first-seed 2 --seeds 1` plans only seed 2's runs, so a later session extends seeds 0-1 in place;
    # that seed then draws the curve and the data-size runs, as seed 0 does in a run of its own.
    size = replace(bench_quality.SIZES["cpu"], seeds=1)
    runs = bench_quality.plan_runs(tmp_path, size, ["lossless", "q4"], {"a": ()}, first_seed=2)
    assert sorted(r.name for r in runs) == ["a-lossless-f0.25-s2", "a-lossless-f1-s2", "a-q4-f1-s2"]
    assert [r.name for r in runs if r.curve] == ["a-lossless-f1-s2"]
    assert all(r.dir == tmp_path / r.name for r in runs)


def test_gen_batch_generates_every_row_in_batches_of_that_many_and_records_it(
    tmp_path: Path, monkeypatch
) -> None:
    # The hybrid's rows took ~370 s in 17 batches of 1024 on the H200 (its decoding is bound by steps, not
    # rows): --gen-batch trades the size's batch for fewer steps, and the rows it makes say which batch made them.
    import pyarrow.ipc as ipc

    batches = []
    generate = quality_data.greedy_continuations

    def spy(target_dir, prompts, spec, pad_id, device):
        batches.append(spec.gen_batch)
        return generate(target_dir, prompts, spec, pad_id, device)

    monkeypatch.setattr(quality_phases, "greedy_continuations", spy)
    work = tmp_path / "q"
    assert bench_quality.main(_ci_argv(work, "--stop-after", "data", "--gen-batch", "7")) == 0
    data = bench_quality.SIZES["ci"].data
    meta = json.loads((work / "data" / "rows.json").read_text())
    assert batches == [7] and meta["gen_batch"] == 7 and meta["rows"] == data.train_rows + data.eval_rows
    table = ipc.open_file(str(work / "data" / "rows.arrow")).read_all()
    answers = [sum(m) for m in table.column("loss_mask").to_pylist()]
    assert answers == [data.new_tokens] * meta["rows"]


def test_a_work_folder_of_another_size_or_target_is_refused_before_any_phase(tmp_path: Path) -> None:
    # Phases are reused when their outputs exist: a --work built at the ci size must not be trained and scored
    # as the cpu size's target (a run of 40 minutes on a 100k-parameter LM, tau_walk saturated at the block).
    work = tmp_path / "q"
    (work / "target").mkdir(parents=True)
    ci = asdict(bench_quality.SIZES["ci"].target)
    del ci["kind"]  # written before targets had kinds: code
    (work / "target" / "bench_target.json").write_text(json.dumps({"spec": ci}))
    with pytest.raises(SystemExit) as refused:
        bench_quality.main(["--size", "cpu", "--device", "cpu", "--work", str(work), "--stop-after", "data"])
    message = str(refused.value)
    assert message.startswith("error: --size cpu --target code: ") and "\n" not in message
    assert "hidden 48 (wants 128)" in message and message.endswith("use another --work")
    assert not (work / "tokens").exists() and not (work / "data").exists()  # nothing was built beside it
    # The size it was built for passes the check; a speed-only setting (compile) does not count.
    assert bench_quality.work_mismatch(work, bench_quality.SIZES["ci"]) is None
    ci_compiled = replace(
        bench_quality.SIZES["ci"], target=replace(bench_quality.SIZES["ci"].target, compile="reduce-overhead")
    )
    assert bench_quality.work_mismatch(work, ci_compiled) is None
    hybrid = replace(
        bench_quality.SIZES["ci"], target=replace(bench_quality.SIZES["ci"].target, kind="hybrid")
    )
    assert "kind code (wants hybrid)" in bench_quality.work_mismatch(work, hybrid)
    # Rows cut for another size are refused too.
    (work / "data").mkdir()
    (work / "data" / "rows.json").write_text(json.dumps({"train_rows": 7, "eval_rows": [7, 8]}))
    assert "holds 7 training and 2 evaluation rows (wants 48 and 12)" in bench_quality.work_mismatch(
        work, bench_quality.SIZES["ci"]
    )


def _split(full: tuple[float, float, float, float], none: tuple[float, float, float, float]) -> dict:
    """An evaluation's split keys with no anchor where lookup accepts part of the block."""
    keys = {"walk_split_anchors": 10, "walk_split_part_share": 0.0, "tau_walk_max": 2.5}
    for name, (share, drafter, lookup, whole) in (("full", full), ("none", none)):
        keys |= {f"walk_split_{name}_share": share, f"walk_split_{name}_drafter": drafter,
                 f"walk_split_{name}_lookup": lookup, f"walk_split_{name}_drafter_full": whole}  # fmt: skip
    return keys


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


def test_split_table_prints_each_runs_classes_and_skips_old_reports(capsys) -> None:
    report = {
        "size": {"drafter": {"block_size": 8}},
        "baselines": {"untrained": _split((0.3, 0.0, 7.0, 0.0), (0.7, 0.01, 0.0, 0.0))},
        "runs": [{"run": "base-lossless-f1-s0", **_split((0.3, 2.31, 7.0, 0.07), (0.7, 0.62, 0.0, 0.01))},
                 {"run": "failed-run", "error": "boom"}],
    }  # fmt: skip
    print_split_table(report)
    lines = capsys.readouterr().out.splitlines()
    assert "lookup all 7" in lines[2] and "lookup 1-6" in lines[2]
    (row,) = [line for line in lines if line.startswith("base-lossless-f1-s0")]
    assert row.split()[1:] == ["30%", "2.31/7.00", "7%", "0%", "-", "70%", "0.62/0.00", "1%", "2.500"]
    assert not any(line.startswith("failed-run") for line in lines)
    # A report written before the split prints no split table.
    report["runs"] = [{"run": "old", "tau": 2.0}]
    report["baselines"]["untrained"] = {"tau": 1.0}
    print_split_table(report)
    assert capsys.readouterr().out == ""


# --- more targets: prose (chat rows of docs) and hybrid (Qwen3.5's Gated DeltaNet) ---------------------------


def _run_target(work: Path, target: str, *extra: str) -> dict:
    """One target at the ci size on one cache and all rows: what its own baseline and drafter need."""
    argv = ["--size", "ci", "--device", "cpu", "--work", str(work), "--target", target]
    assert bench_quality.main([*argv, "--codecs", "lossless", "--fractions", "1", *extra]) == 0
    return json.loads((work / target / "runs" / "quality.json").read_text())


def _assert_scored(report: dict, target: str) -> None:
    assert report["target_kind"] == target == report["size"]["target"]["kind"]
    lookup, (run,) = report["baselines"]["prompt_lookup"], report["runs"]
    b = bench_quality.SIZES["ci"].drafter.block_size
    assert lookup["eval_samples"] == run["eval_samples"] == bench_quality.SIZES["ci"].data.eval_rows
    assert 1.0 <= lookup["tau_walk"] <= b and 1.0 <= run["tau"] <= b and 1.0 <= run["tau_walk"] <= b


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


def test_a_work_folder_above_quality_targets_layout_is_refused_not_rebuilt(tmp_path: Path) -> None:
    # `quality_targets.sh start W hybrid` passes --work W/hybrid, so the target sits in W/hybrid/hybrid; a later
    # `--work W --target hybrid` looked in W/hybrid, found no target and built another (a whole device call).
    for kind, built in (("hybrid", "qt/hybrid/hybrid"), ("code", "qt/code")):
        (tmp_path / built / "target").mkdir(parents=True)
        (tmp_path / built / "target" / "bench_target.json").write_text("{}")
        with pytest.raises(SystemExit) as refused:
            bench_quality.main(_ci_argv(tmp_path / "qt", "--target", kind, "--stop-after", "data"))
        message = str(refused.value)
        assert message.startswith(f"error: --work {tmp_path / 'qt'}: ") and "\n" not in message
        assert message.endswith(f"pass --work {tmp_path / 'qt' / kind}")
        assert bench_quality.nested_work(tmp_path / "qt" / kind, kind) is None  # what it says to pass
    assert not (tmp_path / "qt" / "tokens").exists() and not (tmp_path / "qt" / "hybrid" / "tokens").exists()


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


def test_prose_target_trains_on_chat_rows_and_packs_into_its_own_folder(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    from transformers import AutoTokenizer

    work, pack = tmp_path / "q", tmp_path / "pack"
    report = _run_target(work, "prose", "--pack", str(pack))
    _assert_scored(report, "prose")
    assert "target prose:" in capsys.readouterr().out
    assert not (work / "target").exists()  # the code target's place is left to it
    # Every row's prompt is a user turn and the start of the assistant's answer; the target's continuation
    # (the supervised part) follows it.
    import pyarrow as pa

    tokenizer = AutoTokenizer.from_pretrained(str(work / "prose" / "target"))
    rows = pa.ipc.open_file(str(work / "prose" / "data" / "rows.arrow")).read_all()
    for ids, mask in zip(rows["input_ids"].to_pylist(), rows["loss_mask"].to_pylist(), strict=True):
        prompt = tokenizer.decode(ids[: mask.index(1)])
        assert prompt.startswith("<|im_start|>user\n") and "<|im_end|>\n<|im_start|>assistant\n" in prompt
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") != tokenizer.unk_token_id
    # What the target read is chat rows of prose read from this machine: no line of Python among them.
    import numpy as np

    from bench.quality_prose import _CODE_LINE

    corpus = tokenizer.decode(np.load(work / "prose" / "tokens" / "train.npy").tolist())
    turns = corpus.split("<|im_start|>")[1:]
    assert len(turns) > 100 and all(t.startswith(("user\n", "assistant\n")) for t in turns)
    assert _CODE_LINE.search(corpus) is None
    # Its pack parts are its own and carry everything a later call needs: no corpus is read again.
    assert sorted(p.name for p in pack.iterdir()) == ["quality-work-prose.txz.00"]

    def no_corpus(*_args):
        raise AssertionError("the corpus was read again")

    monkeypatch.setattr(quality_phases, "read_prose_corpus", no_corpus)
    again = tmp_path / "again"
    argv = _ci_argv(again, "--target", "prose", "--unpack", str(pack))
    assert bench_quality.main([*argv, "--stop-after", "data"]) == 0
    for name in ("target/model.safetensors", "target/tokenizer.json", "data/rows.arrow"):
        assert (again / "prose" / name).read_bytes() == (work / "prose" / name).read_bytes()


@pytest.mark.slow
def test_hybrid_target_is_a_gated_deltanet_model_through_every_phase(tmp_path: Path) -> None:
    report = _run_target(tmp_path, "hybrid")
    _assert_scored(report, "hybrid")
    config = json.loads((tmp_path / "hybrid" / "target" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["tie_word_embeddings"]
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    manifest = json.loads((tmp_path / "hybrid" / "cache-lossless" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["target"]["model_type"] == "qwen3_5_text"
    # About the code target's size, so `--size quick` fits the same time on a GPU.
    code = quality_target.target_config(bench_quality.SIZES["quick"].target, quality_target.SizedVocab(4096))
    hybrid_spec = replace(bench_quality.SIZES["quick"].target, kind="hybrid")
    sizes = [
        _params(c) for c in (code, quality_target.target_config(hybrid_spec, quality_target.SizedVocab(4096)))
    ]
    assert abs(sizes[1] / sizes[0] - 1) < 0.02


def test_hybrid_target_trains_through_the_torch_delta_rule_and_leaves_it_as_it_was() -> None:
    """On the GPU FLA's gated delta-rule backward is refused (Triton < 3.7.1 on Hopper): the target's training
    must reach transformers' torch code whichever way this transformers dispatches, and generation after it
    must find the dispatch as it was."""
    import inspect
    import sys

    import torch

    spec = replace(bench_quality.SIZES["ci"].target, kind="hybrid")
    model = quality_target.target_model(
        quality_target.target_config(spec, quality_target.SizedVocab(spec.vocab))
    )
    modeling = sys.modules[type(model).__module__]
    before = {id(m): getattr(m, "chunk_gated_delta_rule", None) for m in model.modules()}
    dispatch = modeling.torch_chunk_gated_delta_rule
    torch_code = quality_target.torch_code(dispatch)  # under the dispatch wrappers: the torch code
    assert torch_code is not dispatch and "def torch_chunk_gated_delta_rule" in inspect.getsource(torch_code)
    with quality_target.torch_delta_rule_for_training(model) as what:
        assert what and "torch" in what
        ids = torch.randint(0, spec.vocab, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        layers = [m for m in model.modules() if callable(getattr(m, "chunk_gated_delta_rule", None))]
        assert all(quality_target.torch_code(m.chunk_gated_delta_rule) is torch_code for m in layers)
        assert layers or modeling.torch_chunk_gated_delta_rule is torch_code
    assert modeling.torch_chunk_gated_delta_rule is dispatch
    assert {id(m): getattr(m, "chunk_gated_delta_rule", None) for m in model.modules()} == before
    # a model with no delta-rule layer is left alone
    plain = quality_target.target_model(
        quality_target.target_config(bench_quality.SIZES["ci"].target, quality_target.SizedVocab(384))
    )
    with quality_target.torch_delta_rule_for_training(plain) as what:
        assert what is None


def test_greedy_continuations_pick_deterministic_kernels_and_restore_the_mode(monkeypatch) -> None:
    """The same target's rows differed between two sessions' H200s: generation runs on deterministic kernels
    (warn-only: a kernel without one must not stop the data phase after the target's build)."""
    import numpy as np
    import torch
    import transformers

    modes = []

    class Greedy:  # a stand-in LM: answers zeros, records the mode it generated under
        def to(self, device):
            return self

        def eval(self):
            return self

        def generate(self, input_ids, max_new_tokens, **kw):
            modes.append((torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled()))  # fmt: skip
            return torch.cat(
                [input_ids, torch.zeros(input_ids.shape[0], max_new_tokens, dtype=torch.long)], 1
            )

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Greedy())
    spec = replace(bench_quality.SIZES["ci"].data, gen_batch=2)
    prompts = [np.arange(1, n, dtype=np.int32) for n in (5, 9, 7)]
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    answers = quality_data.greedy_continuations(Path("unused"), prompts, spec, pad_id=0, device="cpu")
    assert [len(a) for a in answers] == [spec.new_tokens] * 3
    assert modes == [(True, True)] * 2  # two batches of at most 2 rows
    assert (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled()) == before  # fmt: skip


def test_target_trains_under_strict_determinism_and_records_its_weights_digest(
    tmp_path: Path, monkeypatch
) -> None:
    """Two builds of one target on one H200 differed (cuDNN's attention backward, let through by warn-only
    determinism): the target trains with determinism strict, the mode as it was afterwards, and
    bench_target.json carries the saved weights' digest, the same for two builds from one seed."""
    import hashlib

    import numpy as np
    import torch

    spec = replace(bench_quality.SIZES["ci"].target, steps=3)
    modes = []
    make = quality_target.target_model

    def recording(config):
        model = make(config)
        model.register_forward_pre_hook(lambda *_: modes.append((
            torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
        )))  # fmt: skip
        return model

    monkeypatch.setattr(quality_target, "target_model", recording)
    files = [np.random.default_rng(0).integers(1, spec.vocab, 4 * spec.seq_len)]
    digests = []
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        info = quality_target.train_target(
            spec, quality_target.SizedVocab(spec.vocab), files, tmp_path / name, "cpu", seed=0
        )
        weights = (tmp_path / name / "model.safetensors").read_bytes()
        assert info["weights_sha256"] == hashlib.sha256(weights).hexdigest()
        digests.append(info["weights_sha256"])
    assert digests[0] == digests[1]
    assert modes and set(modes) == {(True, False)}
    assert (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    ) == before


def _params(config) -> int:
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in quality_target.target_model(config).parameters())


_SOURCE = '''"""A module about parsing configuration files, written for people who read it in a terminal window. It says so plainly and at some length, so that nobody has to guess."""


class Reader:
    """Reads a configuration file and remembers every section it has seen so far, in the order met. It says so plainly and at some length, so that nobody has to guess."""

    def read(self, path):
        """Opens the file at the given path and returns the sections found in it, one after the other, as a list. It says so plainly and at some length, so that nobody has to guess."""

    def example(self):
        """Shows the reader at work on a small file of two sections.

        >>> Reader().read("settings.ini")
        ['main', 'extra']
        """
'''

_DOCUMENT = """Installing the package
======================

The package installs with the ordinary installer and needs nothing else on the machine where it runs.
It reads its settings from a file in the home folder when one is there, and uses its defaults otherwise.

    pip install --upgrade example-package
    {"settings": [1, 2, 3], "more": {"a": 1}}

Everything it writes goes to a folder of its own, so removing that folder removes every trace of it.
"""


def test_prose_rows_are_chat_turns_of_docstrings_and_documents_without_code(tmp_path: Path) -> None:
    from bench.quality_prose import ASSISTANT, chat_row, docstring_rows, document_rows, is_prose

    rows = list(docstring_rows(_SOURCE, "pkg.config"))
    # Qualified names; the docstring with a doctest is code, not prose, and is left out.
    assert rows == [
        chat_row("Explain pkg.config.", _SOURCE.split('"""')[1]),
        chat_row("Explain pkg.config.Reader.", _SOURCE.split('"""')[3]),
        chat_row("Explain pkg.config.Reader.read.", _SOURCE.split('"""')[5]),
    ]
    assert rows[0].startswith("<|im_start|>user\nExplain pkg.config.<|im_end|>\n" + ASSISTANT)
    (section,) = document_rows(_DOCUMENT)
    user, answer = section.removesuffix("<|im_end|>\n").split(ASSISTANT)
    assert user == "<|im_start|>user\nExplain Installing the package.<|im_end|>\n"
    # The indented literal block (a command, JSON) is dropped; the prose around it is kept.
    assert "pip install" not in answer and "settings" in answer and answer.endswith("every trace of it.")
    assert not is_prose("def f(x):\n    return x + 1\n" * 20) and not is_prose("| 1 | 2 | 3 |\n" * 40)


def test_prose_corpus_holds_sources_out_by_name_and_never_repeats_an_answer(
    tmp_path: Path, monkeypatch
) -> None:
    from bench import quality_prose

    doc = "A paragraph of plain words that explain how the example works, sentence after sentence. " * 3
    names = [f"stdlib/notes/file{i}.txt" for i in range(40)]
    assert 0 < sum(map(quality_data.is_heldout, names)) < len(names)
    sources = []
    for i, name in enumerate(names):
        (tmp_path / f"{i}.txt").write_text(f"Topic {i}\n========\n\n{doc}{i}.\n")
        sources.append((name, tmp_path / f"{i}.txt"))
    (tmp_path / "dup.txt").write_text((tmp_path / "0.txt").read_text())  # file0's row, word for word
    sources.append(("stdlib/notes/zz-copy.txt", tmp_path / "dup.txt"))
    monkeypatch.setattr(quality_prose, "prose_sources", lambda: sources)
    train, held, stats = quality_prose.read_prose_corpus(10**9, seed=0)
    assert stats["files"] == len(names) and stats["heldout_files"] == sum(map(quality_data.is_heldout, names))
    for i, name in enumerate(names):
        (row,) = [r for r in train + held if f"Explain Topic {i}." in r]
        assert (row in held) == quality_data.is_heldout(name)
    assert not set(train) & set(held) and len(train) + len(held) == len(set(train + held)) == len(names)
    assert all(r.startswith("<|im_start|>user\n") and r.endswith("<|im_end|>\n") for r in train + held)
    # A different seed reads the same sources in another order, and splits them the same way.
    _, held2, stats2 = quality_prose.read_prose_corpus(10**9, seed=1)
    assert sorted(held2) == sorted(held) and stats2["sha256"] != stats["sha256"]


def test_chat_prompts_are_a_user_turn_and_the_start_of_its_answer() -> None:
    import numpy as np

    from bench.quality_data import DataSpec
    from bench.quality_prose import cut_chat_prompts

    header = np.array([7, 8], dtype=np.int32)
    rows = [np.array([1, 2, 3, 7, 8, *range(20, 60)], dtype=np.int32), np.array([1, 2] * 40, np.int32)]
    spec = DataSpec(train_rows=0, eval_rows=0, prompt_min=4, prompt_max=12, new_tokens=4, gen_batch=1)
    prompts = cut_chat_prompts(rows, 50, spec, header=header, rng=np.random.default_rng(0))
    lengths = {len(p) for p in prompts}
    assert min(lengths) == 6 and max(lengths) == 12 and len(lengths) > 3  # >= 1 answer token, <= prompt_max
    assert all((p == rows[0][: len(p)]).all() for p in prompts)  # the row without a header is never cut


def _poll(work: Path, dest: Path, seconds: int = 300) -> subprocess.CompletedProcess:
    script = Path(__file__).parents[1] / "bench" / "quality_targets.sh"
    argv = ["bash", str(script), "poll", str(work), str(seconds), str(dest)]
    env = {**os.environ, "POLL_EVERY": "0.2"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=20, env=env)


def test_poll_ends_at_once_on_a_machine_that_did_not_start_the_runs(tmp_path: Path) -> None:
    # A device call that lands on a fresh machine once polled an empty folder for its whole 560 s.
    done = _poll(tmp_path / "qt", tmp_path / "dest")
    assert done.returncode == 3
    assert "no run logs under" in done.stderr and "qt" in done.stderr
    assert not (tmp_path / "dest").exists()


def test_poll_copies_an_ended_runs_report_and_evaluations_then_stops(tmp_path: Path) -> None:
    work = tmp_path / "qt"
    run = work / "code" / "runs" / "base-fp8-f1-s0"
    run.mkdir(parents=True)
    evaluation = {"step": 1500, "tau": 5.0, "tau_walk": 3.9, "tau_walk_lookup": 2.8}
    lines = [json.dumps(evaluation), json.dumps({"step": 1510, "loss": 2.0})]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (work / "code" / "runs" / "quality.json").write_text('{"runs": []}')
    (work / "code.log").write_text("[train] 900 s\n== exit 0\n")
    (work / "pack").mkdir()
    (work / "pack" / "quality-work.txz.00").write_bytes(b"part")
    done = _poll(work, tmp_path / "dest")
    assert done.returncode == 0, done.stderr
    assert "base-fp8-f1-s0: step 1510; last eval step 1500, tau 5.0, tau_walk 3.9" in done.stdout
    tail = (tmp_path / "dest" / "code.log.tail").read_text()
    assert "== exit 0" in tail and '"tau_walk": 3.9' in tail
    assert json.loads((tmp_path / "dest" / "code-quality.json").read_text()) == {"runs": []}
    assert (tmp_path / "dest" / "quality-work.txz.00").read_bytes() == b"part"  # `--pack W/pack` comes back


def test_poll_prints_a_targets_phase_once_and_every_runs_step_each_round(tmp_path: Path) -> None:
    # A device call's reply keeps only the end of its output: one unchanged phase line a round filled it.
    work = tmp_path / "qt"
    run = work / "hybrid" / "runs" / "base-fp8-f1-s0"
    run.mkdir(parents=True)
    evaluation = {
        "step": 1000,
        "tau": 3.2671588678,
        "tau_walk": 2.7475787941,
        "tau_walk_lookup": 2.7554869492,
    }
    (run / "metrics.jsonl").write_text(json.dumps(evaluation) + "\n")
    (work / "hybrid.log").write_text("[extract q4] 161 s\n")  # still running: no `== exit`
    done = _poll(work, tmp_path / "dest", seconds=1)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("== hybrid: [extract q4] 161 s") == 1
    run_line = (
        "base-fp8-f1-s0: step 1000; last eval step 1000, tau 3.267, tau_walk 2.748, tau_walk_lookup 2.755"
    )
    assert done.stdout.count(run_line) >= 2


def test_recipe_defaults_trains_what_dflash_train_does_with_no_recipe_flag(tmp_path: Path) -> None:
    from dflash.train.cli import build_config
    from dflash.train.config import default_recipe

    size = quality_sizes.with_trainer_defaults(bench_quality.SIZES["full"])
    runs = quality_sizes.plan_runs(tmp_path, replace(size, seeds=2, fractions=(1.0,)), ["fp8"], {"base": ()})
    meta = {"eval_rows": [7, 8]}
    for run in runs:
        flags = quality_phases.run_flags(run, tmp_path, size, meta, "cuda", [])
        trained = build_config(flags)
        plain = default_recipe(cache=trained.cache, out=trained.out)
        # Every choice of the recipe is the trainer's own (the evaluation and logging flags differ only).
        assert trained.drafter == plain.drafter and trained.optim == plain.optim
        assert (size.drafter.layers, size.drafter.lr) == (
            plain.drafter.num_draft_layers,
            plain.optim.lr,
        )  # reported
        assert trained.data.token_budget == plain.data.token_budget == size.drafter.token_budget
        assert trained.eval_every == (quality_sizes.DEFAULTS_CURVE_EVERY if run.curve else 1 << 30)
    # --steps still bounds such a run, and nothing else of the recipe changes.
    short = replace(size, drafter=replace(size.drafter, steps=300))
    flags = quality_phases.run_flags(runs[1], tmp_path, short, meta, "cuda", [])
    assert build_config(flags).optim.max_steps == 300
    # The evaluation is built from the size's block size, anchors and pack budget: a size whose differ from the
    # trainer's defaults is refused, not scored on another block size.
    with pytest.raises(ValueError, match="block_size is 8, dflash-train's 16"):
        quality_sizes.with_trainer_defaults(bench_quality.SIZES["ci"])


def test_the_curve_line_reads_the_schedule_as_dflash_train_does(capsys) -> None:
    """The e10 question (is 6 epochs short?) is read off each variant's curve: rising / peaked / flat."""

    def curve_line(walks: dict[int, float]) -> str:
        points = [{"step": s, "tau": 2.0, "tau_walk": w} for s, w in walks.items()]
        lookup = {"tau": 1.5, "tau_walk": 1.5, "eval_samples": 4}
        report = {
            "baselines": {"prompt_lookup": lookup, "untrained": {"tau": 1.0, "tau_walk": 1.0}},
            "size": {"drafter": {"block_size": 16}}, "table": [], "runs": [], "seconds": {},
            "curves": [{"run": "base-fp8-f1-s0", "points": points}],
        }  # fmt: skip
        print_table(report)
        return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("tau/tau_walk"))

    hybrid = {1000: 2.664, 2000: 3.285, 3000: 3.643, 3918: 3.726}  # the defaults' seed 0 (BENCHMARKS.md)
    assert curve_line(hybrid).endswith("3918: 2.00/3.73; still rising: +2.3% from step 3000")
    prose = {1000: 1.680, 2000: 1.719, 3000: 1.715, 3767: 1.701}
    assert curve_line(prose).endswith("; peaked at step 2000, +1.1% over the end")
    assert curve_line({1000: 3.0, 3000: 3.60, 4000: 3.62}).endswith("4000: 2.00/3.62")  # flat: nothing said


def test_quality_resume_goes_on_from_a_finished_run_in_a_copy_as_a_user_would(tmp_path: Path) -> None:
    from bench import quality_resume

    work = tmp_path / "q"
    assert bench_quality.main(_ci_argv(work, "--codecs", "fp8", "--fractions", "1")) == 0
    runs = work / "runs"
    before = (runs / "base-fp8-f1-s0" / "metrics.jsonl").read_text()
    assert quality_resume.main([str(runs), "base-fp8-f1-s0", "more", "--max-steps", "20"]) == 0
    # the finished run is left as it was; the copy went on to the new length, evaluated and exported
    assert (runs / "base-fp8-f1-s0" / "metrics.jsonl").read_text() == before
    steps = [json.loads(line)["step"] for line in (runs / "more" / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 20 and 12 in steps
    assert (runs / "more" / "final" / "config.json").is_file()
    flags = json.loads((runs / "more.cmd.json").read_text())
    assert flags[flags.index("--out") + 1] == str(runs / "more") and flags[-3:] == [
        "--resume",
        "--max-steps",
        "20",
    ]
    assert "schedule restarts over the added steps" in (runs / "more.log").read_text()
    with pytest.raises(SystemExit, match="exists"):
        quality_resume.main([str(runs), "base-fp8-f1-s0", "more"])
    with pytest.raises(SystemExit, match="not a finished benchmark run"):
        quality_resume.main([str(runs), "nothing", "other"])
