"""The built-in tiny target and tokenizer: deterministic, loadable as a HF dir, a free embedding row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dflash.tools import tiny, tiny_train
from dflash.tools.chat import has_generation_markers
from safetensors.torch import load_file


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> tuple[Path, tiny.TinyTargetInfo]:
    out = tmp_path_factory.mktemp("tiny") / "target"
    return out, tiny.build_tiny_target(out, size="test", seed=0)


def test_two_builds_give_identical_weights(tmp_path, target):
    path, info = target
    again = tiny.build_tiny_target(tmp_path / "again", size="test", seed=0)
    a, b = load_file(path / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert (path / "tokenizer.json").read_bytes() == (tmp_path / "again" / "tokenizer.json").read_bytes()
    assert again.final_loss == info.final_loss
    other = tiny.build_tiny_target(tmp_path / "other", size="test", seed=1)
    assert not torch.equal(
        load_file(tmp_path / "other" / "model.safetensors")["lm_head.weight"], a["lm_head.weight"]
    )
    assert other.path != info.path


def test_build_leaves_torch_settings_alone(tmp_path):
    threads = torch.get_num_threads()
    rng_state = torch.get_rng_state()
    tiny.build_tiny_tokenizer(tmp_path, vocab_size=300)
    with tiny_train.reproducible_torch():
        assert torch.get_num_threads() == 1 and torch.are_deterministic_algorithms_enabled()
    assert torch.get_num_threads() == threads and not torch.are_deterministic_algorithms_enabled()
    assert torch.equal(torch.get_rng_state(), rng_state)


def test_saved_dir_is_a_complete_hf_target(target):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path, info = target
    model = AutoModelForCausalLM.from_pretrained(str(path))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    config = AutoConfig.from_pretrained(str(path))
    assert config.model_type == "qwen3" and type(model).__name__ == "Qwen3ForCausalLM"
    assert (path / "model.safetensors").exists() and not list(path.glob("*.bin"))
    # A free row for the drafter's mask token, as in real Qwen checkpoints.
    assert config.vocab_size > len(tokenizer) == info.tokenizer_len
    assert model.get_input_embeddings().weight.shape[0] == config.vocab_size == info.vocab_size
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert config.eos_token_id == tokenizer.eos_token_id and config.pad_token_id == tokenizer.pad_token_id
    assert has_generation_markers(tokenizer.chat_template)
    ids = tokenizer("any text at all: ünïcödé 123 <tag>", add_special_tokens=False)["input_ids"]
    assert max(ids) < len(tokenizer) and tokenizer.decode(ids) == "any text at all: ünïcödé 123 <tag>"
    assert json.loads((path / "tiny_build.json").read_text())["final_loss"] == info.final_loss


def test_training_learned_something(target):
    _, info = target
    assert info.final_loss < 0.6 * info.first_loss


def test_builtin_prompts_are_deterministic_chat_prompts():
    prompts = tiny.builtin_prompts(50)
    assert prompts == tiny.builtin_prompts(50) and len(prompts) == 50
    assert tiny.builtin_prompts(50, seed=2) != prompts
    assert tiny.builtin_prompts(10) == prompts[:10]
    for conv in prompts:
        assert conv[-1]["role"] == "user" and all(m["role"] in ("system", "user") for m in conv)
    assert len({conv[-1]["content"] for conv in prompts}) > 25


def test_greedy_completions_are_deterministic_and_tokenizable(tmp_path, target):
    from dflash.tools.tokenize import TokenizeConfig, tokenize_chats

    path, _ = target
    prompts = tiny.builtin_prompts(12)
    first = tiny.generate_completions(path, path, prompts, max_new_tokens=16, batch_size=5)
    assert first == tiny.generate_completions(path, path, prompts, max_new_tokens=16, batch_size=12)
    for prompt, conv in zip(prompts, first, strict=True):
        assert (
            conv[:-1] == prompt and conv[-1]["role"] == "assistant" and isinstance(conv[-1]["content"], str)
        )
    data = tiny.write_chat_jsonl(first, tmp_path / "chats.jsonl")
    assert [json.loads(line)["messages"] for line in data.read_text().splitlines()] == first
    summary = tokenize_chats(TokenizeConfig(data=str(data), tokenizer=str(path), out=str(tmp_path / "tok")))
    assert summary["rows_in"] == 12 and summary["mask_source"] == "generation_markers"


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="unknown tiny size"):
        tiny.build_tiny_target("/nonexistent", size="huge")
    with pytest.raises(ValueError, match="multiple of num_heads"):
        tiny.TinySize(
            hidden_size=30,
            num_layers=1,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=8,
            bpe_vocab=320,
            train_chats=1,
            train_steps=1,
            batch_size=1,
            lr=1e-3,
        )
    with pytest.raises(ValueError, match="max_new_tokens"):
        tiny.generate_completions("/x", "/x", [], max_new_tokens=0)
