"""The quality benchmark's targets besides the code LM: prose (chat rows of docs read on this machine) and
hybrid (Qwen3.5's Gated DeltaNet), and how every target is built and decoded reproducibly."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
from common.quality import ci_argv

from bench import bench_quality, quality_data, quality_phases, quality_target


def _run_target(work: Path, target: str, *extra: str) -> dict:
    """One target at the ci size on one cache and all rows: what its own baseline and drafter need."""
    argv = ci_argv(work, "--target", target, "--codecs", "lossless", "--fractions", "1", *extra)
    assert bench_quality.main(argv) == 0
    return json.loads((work / target / "runs" / "quality.json").read_text())


def _assert_scored(report: dict, target: str) -> None:
    assert report["target_kind"] == target == report["size"]["target"]["kind"]
    lookup, (run,) = report["baselines"]["prompt_lookup"], report["runs"]
    b = bench_quality.SIZES["ci"].drafter.block_size
    assert lookup["eval_samples"] == run["eval_samples"] == bench_quality.SIZES["ci"].data.eval_rows
    assert 1.0 <= lookup["tau_walk"] <= b and 1.0 <= run["tau"] <= b and 1.0 <= run["tau_walk"] <= b


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
    argv = ci_argv(again, "--target", "prose", "--unpack", str(pack))
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
