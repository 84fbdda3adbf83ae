"""Issue 31, point 7: `dflash-tokenize` never keeps a row longer than the model can take (a default --max-len
from the model's positions or the tokenizer's limit) and tokenizes one huge message in bounded memory; the
extraction dry run refuses rows past the target's max_position_embeddings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from common.chat_data import make_tokenizers, write_jsonl
from common.extract import write_dataset
from common.hostile import cli, one_error_line, run_measured
from common.targets import make_target
from dflash.extract.cli import main as extract_main
from dflash.tools.chat import cut_conversation
from dflash.tools.tokenize import DEFAULT_MAX_LEN, SUMMARY_NAME, TokenizeConfig, tokenize_chats

RSS_BOUND_MB = 800  # the command itself peaks near 400 MB here; the whole message tokenized took 1.43 GB
WORDS = 10**6


@pytest.fixture(scope="module")
def toks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_tokenizers(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def huge(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One conversation whose answer is a million words (~6 MB of text)."""
    words = " ".join(("alpha", "beta", "gamma", "delta", "epsilon")[i % 5] for i in range(WORDS))
    conv = [{"role": "user", "content": "write a lot"}, {"role": "assistant", "content": words}]
    return write_jsonl(tmp_path_factory.mktemp("data") / "huge.jsonl", [{"messages": conv}])


def _tokenizer_without_limit(src: Path, dst: Path, config: dict | None = None) -> Path:
    shutil.copytree(src, dst)
    settings = json.loads((dst / "tokenizer_config.json").read_text())
    settings.pop("model_max_length", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(settings))
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("mode", ["markers", "offsets"])
def test_huge_message_is_cut_to_the_tokenizers_limit_in_bounded_memory(
    toks: dict[str, Path], huge: Path, tmp_path: Path, mode: str
) -> None:
    out = tmp_path / "out"
    rc, err, rss = run_measured(
        cli("dflash.tools.tokenize", "--data", str(huge), "--tokenizer", str(toks[mode]), "--out", str(out))
    )
    assert rc == 0, err[-2000:]
    assert 0 < rss < RSS_BOUND_MB, f"peak RSS {rss} MB"
    summary = json.loads((out / SUMMARY_NAME).read_text())
    assert summary["max_len"] == 1024 and summary["max_len_from"] == "the tokenizer's model_max_length"
    assert summary["max_seq_len"] == 1024 and summary["truncated_rows"] == 1 and summary["rows_out"] == 1


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (None, DEFAULT_MAX_LEN),
        ({"model_type": "qwen3", "max_position_embeddings": 300}, 300),
        ({"model_type": "qwen3_5", "text_config": {"max_position_embeddings": 200}}, 200),
    ],
)
def test_default_max_len_without_a_tokenizer_limit(
    toks: dict[str, Path], huge: Path, tmp_path: Path, config: dict | None, expected: int
) -> None:
    tok = _tokenizer_without_limit(toks["markers"], tmp_path / "tok", config)
    summary = tokenize_chats(TokenizeConfig(data=str(huge), tokenizer=str(tok), out=str(tmp_path / "out")))
    assert summary["max_len"] == expected and summary["max_seq_len"] == expected, summary
    assert summary["max_len_from"] == (
        "the default" if config is None else f"max_position_embeddings of {tok}/config.json"
    )


def test_explicit_max_len_wins(toks: dict[str, Path], huge: Path, tmp_path: Path) -> None:
    cfg = TokenizeConfig(
        data=str(huge), tokenizer=str(toks["offsets"]), out=str(tmp_path / "out"), max_len=64
    )
    summary = tokenize_chats(cfg)
    assert (summary["max_len"], summary["max_len_from"], summary["max_seq_len"]) == (64, "--max-len", 64)


def test_cut_conversation_keeps_a_prefix_of_the_contents() -> None:
    conv = [
        {"role": "user", "content": "abcd"},
        {"role": "assistant", "content": "efghij"},
        {"role": "user", "content": "k"},
    ]
    assert cut_conversation(conv, 100) == (conv, False)
    assert cut_conversation(conv, 11) == (conv, False)
    assert cut_conversation(conv, 10) == (conv[:2], True)
    kept, cut = cut_conversation(conv, 7)
    assert cut and kept == [conv[0], {"role": "assistant", "content": "efg"}]
    assert cut_conversation(conv, 4) == ([conv[0]], True)


def test_last_turn_beyond_the_cut_is_skipped_by_reason(toks: dict[str, Path], tmp_path: Path) -> None:
    """With --last-turn-only, a conversation whose last answer lies past what --max-len keeps is skipped
    (counted by reason, as the truncation of old did), never trained on an earlier turn instead."""
    long = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": " ".join(["word"] * 5000)},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "the last answer"},
    ]
    short = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a short answer"}]
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": long}, {"messages": short}])
    cfg = TokenizeConfig(
        data=str(data),
        tokenizer=str(toks["markers"]),
        out=str(tmp_path / "o"),
        max_len=64,
        last_turn_only=True,
    )
    summary = tokenize_chats(cfg)
    assert summary["rows_out"] == 1 and summary["skipped"] == {"no_supervised_after_truncation": 1}, summary


# --- the extraction dry run --------------------------------------------------------------------------------


def test_extract_dry_run_refuses_rows_past_max_position_embeddings(tmp_path: Path, capsys) -> None:
    target = make_target(tmp_path / "t", "qwen3")  # max_position_embeddings 1024
    rng = np.random.default_rng(0)
    rows = [(rng.integers(3, 200, n).astype(np.int64), np.ones(n, np.uint8)) for n in (50, 1500, 3000)]
    dataset = write_dataset(tmp_path / "ds", rows)
    base = ["--target", str(target), "--dataset", str(dataset), "--out", str(tmp_path / "c"), "--dry-run"]
    assert extract_main([*base, "--max-len", "1000000"]) == 2
    line = one_error_line(capsys.readouterr().err, "dflash-extract")
    assert (
        "2 rows are longer than the target's max_position_embeddings 1,024 (the longest 3,000 tokens" in line
    )
    assert "pass --max-len 1024 or less" in line
    assert extract_main([*base, "--max-len", "1024"]) == 0  # rows cut to the limit: planned
    assert not (tmp_path / "c").exists()
