"""The drafter model: layer-id rule, config from a target config, forward semantics, frozen target loading."""

from __future__ import annotations

import json

import pytest
import torch
from dflash.shards.errors import ShardError
from dflash.shards.layers import default_layer_ids as default_target_layer_ids
from dflash.train.blocks import SequenceInput, make_packed_batch
from dflash.train.drafter_config import DrafterConfig
from dflash.train.frozen import FrozenTarget, load_frozen_target
from dflash.train.mask import build_attention_mask
from dflash.train.model import DFlashDrafter
from safetensors.torch import save_file

from tests.common.tiny_shapes import tiny_target

TARGET = tiny_target(intermediate_size=64, vocab_size=96, num_hidden_layers=8, bos_token_id=1, eos_token_id=2)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(
    ("layers", "k", "expected"),
    [
        (36, 5, [1, 9, 17, 25, 33]),
        (64, 5, [1, 16, 31, 46, 61]),
        (32, 5, [1, 8, 15, 22, 29]),
        (36, 1, [18]),
        (28, 3, [1, 13, 25]),
    ],
)
def test_default_target_layer_ids(layers: int, k: int, expected: list[int]) -> None:
    assert default_target_layer_ids(layers, k) == expected


def test_default_target_layer_ids_uses_python_round_half_to_even() -> None:
    # L=8, K=5: 1 + i * 4 / 4 -> exact; L=7, K=3: 1 + i * 3 / 2 -> 1, 2.5 -> 2 (half to even), 4
    assert default_target_layer_ids(7, 3) == [1, 2, 4]
    with pytest.raises(ValueError, match=">= 4 layers"):
        default_target_layer_ids(3, 2)


def test_config_from_target_copies_shape_and_rope() -> None:
    cfg = DrafterConfig.from_target_config(TARGET, mask_token_id=95)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 4, 2, 8)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta, cfg.num_target_layers) == (64, 96, 1e6, 8)
    assert cfg.target_layer_ids == tuple(default_target_layer_ids(8, 5)) and cfg.num_hidden_layers == 5
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.max_position_embeddings) == (1, 2, 256)


def test_config_from_nested_transformers5_target() -> None:
    # Qwen3.5-style wrapper: text settings under text_config, theta under rope_parameters.
    text = {k: v for k, v in TARGET.items() if k != "rope_theta"}
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e6}
    cfg = DrafterConfig.from_target_config(
        {"model_type": "qwen3_5", "text_config": text},
        mask_token_id=90,
        num_hidden_layers=2,
        target_layer_ids=[3, 6],
    )
    assert cfg.rope_theta == 5e6 and cfg.rope_scaling is None and cfg.target_layer_ids == (3, 6)


def test_config_from_moe_target_without_dense_mlp() -> None:
    # Qwen3.5-35B-A3B's text_config has only moe/shared-expert widths: the drafter MLP is 3 x hidden.
    text = {k: v for k, v in TARGET.items() if k != "intermediate_size"}
    text.update(moe_intermediate_size=16, shared_expert_intermediate_size=16)
    cfg = DrafterConfig.from_target_config(
        {"model_type": "qwen3_5_moe", "text_config": text}, mask_token_id=95
    )
    assert cfg.intermediate_size == 3 * 32


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"target_layer_ids": [1, 8]}, r"outside \[0, 8\)"),
        ({"target_layer_ids": []}, "is empty"),
        ({"mask_token_id": 96}, "outside the vocabulary"),
        ({"block_size": 1}, "block_size"),
        ({"num_key_value_heads": 3}, "multiple"),
        ({"bogus": 1}, "unknown DrafterConfig"),
    ],
)
def test_config_rejects_bad_values(override: dict, message: str) -> None:
    kwargs = {"mask_token_id": 95, **override}
    with pytest.raises(ValueError, match=message):
        DrafterConfig.from_target_config(TARGET, **kwargs)


def test_config_accepts_repeated_layer_ids() -> None:
    # The shallow-target rule (shards.layers): a drafter may read one target layer more than once.
    cfg = DrafterConfig.from_target_config(
        TARGET, mask_token_id=95, num_hidden_layers=2, target_layer_ids=[2, 2]
    )
    assert cfg.target_layer_ids == (2, 2) and cfg.num_features == 2


def _setup(seed: int = 0, block_size: int = 4):
    torch.manual_seed(seed)
    cfg = DrafterConfig.from_target_config(
        TARGET, mask_token_id=95, num_hidden_layers=2, block_size=block_size
    )
    model = DFlashDrafter(cfg)
    frozen = FrozenTarget(torch.randn(96, 32), torch.randn(96, 32), TARGET, 95)
    seqs = [
        SequenceInput(torch.randint(0, 90, (s,)), torch.arange(s) >= 2, torch.randn(s, 32 * cfg.num_features))
        for s in (18, 11)
    ]
    batch = make_packed_batch(
        seqs,
        block_size=block_size,
        mask_token_id=95,
        num_anchors=4,
        generator=torch.Generator().manual_seed(seed),
        pad_blocks_to_multiple=3,
    )
    return cfg, model, frozen, batch


def test_parameter_names_are_the_export_names() -> None:
    cfg, model, _, _ = _setup()
    names = set(model.state_dict())
    assert {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.1.self_attn.k_norm.weight",
        "layers.0.mlp.down_proj.weight",
    } <= names
    assert not any("embed" in n or "lm_head" in n or "rotary" in n for n in names)
    assert model.fc.weight.shape == (32, 32 * cfg.num_features)
    assert all(not n.endswith(".bias") for n in names)


def test_forward_is_finite_with_padding_blocks_and_padding_outputs_do_not_matter() -> None:
    _, model, frozen, batch = _setup()
    assert int((batch.block_seq < 0).sum()) > 0
    out = model(batch, frozen.embed(batch.block_ids), build_attention_mask(batch, "dense"))
    assert out.shape == (batch.num_blocks, 4, 32) and torch.isfinite(out).all()
    (out[batch.block_seq >= 0].square().sum()).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_block_token_positions_use_rope_at_anchor_plus_slot() -> None:
    # Shifting every position by the same offset must not change anything (RoPE is relative) ...
    _, model, frozen, batch = _setup()
    mask = build_attention_mask(batch, "dense")
    with torch.no_grad():
        base = model(batch, frozen.embed(batch.block_ids), mask)
        shifted = batch.to("cpu")
        shifted.context_pos = batch.context_pos + 7
        shifted.anchor_pos = batch.anchor_pos + 7
        same = model(shifted, frozen.embed(batch.block_ids), mask)
        # ... but moving only the blocks' positions must.
        moved = batch.to("cpu")
        moved.anchor_pos = batch.anchor_pos + 1
        other = model(moved, frozen.embed(batch.block_ids), mask)
    real = batch.block_seq >= 0
    torch.testing.assert_close(same[real], base[real], atol=2e-5, rtol=1e-4)
    assert (other[real] - base[real]).abs().max() > 1e-3


def _write_cache(
    tmp_path, vocab: int = 96, tokens: int | None = 90, keys=("embed_tokens.weight", "lm_head.weight")
):
    target = tmp_path / "target"
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps({**TARGET, "vocab_size": vocab}))
    save_file(
        {k: torch.randn(vocab, 32).to(torch.bfloat16) for k in keys}, str(target / "frozen.safetensors")
    )
    if tokens is not None:
        vocab_map = {f"t{i}": i for i in range(tokens - 2)}
        added = [{"id": tokens - 2, "content": "<a>"}, {"id": tokens - 1, "content": "<b>"}]
        (target / "tokenizer.json").write_text(
            json.dumps({"model": {"vocab": vocab_map}, "added_tokens": added})
        )
    return tmp_path


def test_load_frozen_target_defaults_mask_to_first_unused_row(tmp_path) -> None:
    frozen = load_frozen_target(_write_cache(tmp_path), dtype=torch.float32)
    assert frozen.mask_token_id == 90 and frozen.vocab_size == 96 and frozen.num_layers == 8
    assert frozen.embed_weight.dtype == torch.float32 and not frozen.embed_weight.requires_grad
    assert frozen.embed(torch.tensor([[3]])).shape == (1, 1, 32)


def test_load_frozen_target_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="no free embedding row"):
        load_frozen_target(_write_cache(tmp_path / "full", tokens=96))
    with pytest.raises(ValueError, match="no free embedding row"):
        load_frozen_target(_write_cache(tmp_path / "notok", tokens=None))
    assert load_frozen_target(tmp_path / "notok", mask_token_id=5).mask_token_id == 5
    with pytest.raises(ShardError, match="missing tensors"):
        load_frozen_target(_write_cache(tmp_path / "nohead", keys=("embed_tokens.weight",)), mask_token_id=5)
    with pytest.raises(FileNotFoundError, match="complete dflash cache"):
        load_frozen_target(tmp_path / "nowhere")


def test_fp32_master_weights_under_bf16_autocast() -> None:
    # The trainer's recipe: fp32 parameters, bf16 compute. Both mask paths must accept the mixed dtypes.
    import warnings

    from dflash.train.loss import drafter_loss

    warnings.filterwarnings("ignore", message=".*flex_attention.*")
    _, model, frozen, batch = _setup(5)
    frozen = frozen.to(dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = drafter_loss(model, frozen, batch, attn_mask=build_attention_mask(batch, "dense"))
        with torch.no_grad():
            dense = model(batch, frozen.embed(batch.block_ids), build_attention_mask(batch, "dense"))
            flex = model(batch, frozen.embed(batch.block_ids), build_attention_mask(batch, "flex"))
    loss.backward()
    assert model.fc.weight.grad.dtype == torch.float32 and torch.isfinite(model.fc.weight.grad).all()
    real = batch.block_seq >= 0
    torch.testing.assert_close(flex[real].float(), dense[real].float(), atol=3e-2, rtol=3e-2)
