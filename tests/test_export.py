"""HF export: exact config keys and weight names, round trip, AutoModel(trust_remote_code) parity, public layout."""

from __future__ import annotations

import ast
import json

import pytest
import torch
from dflash.shards.errors import ShardError
from dflash.train.blocks import SequenceInput, make_packed_batch
from dflash.train.drafter_config import DrafterConfig
from dflash.train.export import export_drafter, hf_config_dict, load_drafter
from dflash.train.frozen import FrozenTarget
from dflash.train.mask import build_attention_mask
from dflash.train.model import DFlashDrafter
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.common.tiny_shapes import tiny_target

TARGET = tiny_target(
    head_dim=16,
    num_hidden_layers=10,
    rms_norm_eps=1e-5,
    max_position_embeddings=512,
    bos_token_id=3,
    eos_token_id=[4, 5],
)
CONFIG_KEYS = {
    "architectures",
    "auto_map",
    "model_type",
    "block_size",
    "num_target_layers",
    "dflash_config",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "attention_bias",
    "tie_word_embeddings",
    "vocab_size",
    "layer_types",
    "dtype",
    "bos_token_id",
    "eos_token_id",
}
LAYER_NAMES = [
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "post_attention_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target_config(TARGET, mask_token_id=60, num_hidden_layers=2, block_size=4)
    model = DFlashDrafter(cfg).eval()
    with torch.no_grad():  # non-trivial norms so a dropped or swapped norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    frozen = FrozenTarget(torch.randn(64, 32), torch.randn(64, 32), TARGET, 60)
    seq = SequenceInput(
        torch.randint(0, 59, (30,)), torch.arange(30) >= 4, torch.randn(30, 32 * cfg.num_features)
    )
    batch = make_packed_batch(
        [seq], block_size=4, mask_token_id=60, num_anchors=6, generator=torch.Generator().manual_seed(0)
    )
    return cfg, model, frozen, seq, batch


def _block_logits(model, frozen, batch):
    with torch.no_grad():
        return frozen.logits(
            model(batch, frozen.embed(batch.block_ids), build_attention_mask(batch, "dense"))
        )


def test_config_keys_and_weight_names_exactly(setup, tmp_path) -> None:
    cfg, model, _, _, _ = setup
    out = export_drafter(model, cfg, tmp_path / "drafter")
    raw = json.loads((out / "config.json").read_text())
    assert set(raw) == CONFIG_KEYS
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert raw["dflash_config"] == {"target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": 60}
    assert (raw["rope_theta"], raw["rope_scaling"], raw["dtype"]) == (1e6, None, "bfloat16")
    assert raw["layer_types"] == ["full_attention"] * 2 and raw["num_target_layers"] == 10
    assert (raw["bos_token_id"], raw["eos_token_id"], raw["block_size"]) == (3, [4, 5], 4)
    assert (
        raw["attention_bias"] is False and raw["tie_word_embeddings"] is False and raw["hidden_act"] == "silu"
    )
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert all(f.get_tensor(n).dtype == torch.bfloat16 for n in names)
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    expected |= {f"layers.{i}.{n}.weight" for i in range(2) for n in LAYER_NAMES}
    assert names == expected
    assert (out / "dflash.py").is_file() and not list(out.glob("*.tmp"))
    assert hf_config_dict(cfg, torch.float32)["dtype"] == "float32"


def test_an_export_cut_off_on_its_weights_leaves_no_config(setup, tmp_path, monkeypatch) -> None:
    """Loaders and engines take a directory with config.json for a model: a disk that fills while the
    weights are written must not leave one beside missing weights."""
    import dflash.train.export as export

    cfg, model, _, _, _ = setup

    def disk_full(*args, **kwargs) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "save_tensors", disk_full)
    with pytest.raises(OSError, match="No space"):
        export_drafter(model, cfg, tmp_path / "drafter")
    assert not (tmp_path / "drafter" / "config.json").exists()
    assert not list((tmp_path / "drafter").iterdir())  # no temp file left either


def test_modeling_file_imports_only_torch_and_transformers(setup, tmp_path) -> None:
    cfg, model, _, _, _ = setup
    source = (export_drafter(model, cfg, tmp_path / "d") / "dflash.py").read_text()
    roots = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add((node.module or "").split(".")[0])
    assert roots <= {"__future__", "torch", "transformers"}


def test_export_then_load_gives_identical_block_logits(setup, tmp_path) -> None:
    cfg, model, frozen, _, batch = setup
    out = export_drafter(model, cfg, tmp_path / "fp32", dtype=torch.float32)
    loaded = load_drafter(out)
    assert loaded.config == cfg
    torch.testing.assert_close(
        _block_logits(loaded, frozen, batch), _block_logits(model, frozen, batch), atol=0, rtol=0
    )
    bf16 = load_drafter(export_drafter(model.state_dict(), cfg, tmp_path / "bf16"))
    assert bf16.fc.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="does not match"):
        export_drafter({"fc.weight": model.fc.weight}, cfg, tmp_path / "bad")


def test_automodel_trust_remote_code_matches_block_logits(setup, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg, model, frozen, seq, batch = setup
    out = export_drafter(model, cfg, tmp_path / "hf", dtype=torch.float32)
    hf = transformers.AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    assert hf.target_layer_ids == list(cfg.target_layer_ids) and hf.mask_token_id == 60 and hf.block_size == 4
    ours = _block_logits(model, frozen, batch)
    for n in range(batch.num_blocks):
        a = int(batch.anchor_pos[n])
        with torch.no_grad():  # the reference's calling convention: context < a, then the block at a..a+B-1
            hidden = hf(
                position_ids=torch.arange(a + 4)[None],
                noise_embedding=frozen.embed(batch.block_ids[n])[None],
                target_hidden=seq.features[:a][None],
            )
        torch.testing.assert_close(frozen.logits(hidden[0]), ours[n], atol=1e-4, rtol=1e-4)


def test_automodel_with_kv_cache_matches_one_shot(setup, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg, model, frozen, seq, _ = setup
    hf = transformers.AutoModel.from_pretrained(
        str(export_drafter(model, cfg, tmp_path / "c", dtype=torch.float32)),
        trust_remote_code=True,
        dtype=torch.float32,
    ).eval()
    block = frozen.embed(torch.tensor([[7, 60, 60, 60]]))
    with torch.no_grad():
        one_shot = hf(
            position_ids=torch.arange(24)[None], noise_embedding=block, target_hidden=seq.features[None, :20]
        )
        cache = transformers.DynamicCache()
        # decode-style: context fed in two pieces, the first block cropped from the cache in between
        hf(
            position_ids=torch.arange(16)[None],
            noise_embedding=block,
            target_hidden=seq.features[None, :12],
            past_key_values=cache,
            use_cache=True,
        )
        cache.crop(12 - cache.get_seq_length())  # negative: drop that many (transformers 4.x and 5.x)
        stepped = hf(
            position_ids=torch.arange(12, 24)[None],
            noise_embedding=block,
            target_hidden=seq.features[None, 12:20],
            past_key_values=cache,
            use_cache=True,
        )
    torch.testing.assert_close(stepped, one_shot, atol=1e-5, rtol=1e-5)


def test_load_public_drafter_layout(setup, tmp_path) -> None:
    cfg, model, frozen, _, batch = setup
    out = export_drafter(model, cfg, tmp_path / "pub", dtype=torch.float32)
    raw = json.loads((out / "config.json").read_text())
    # transformers-5 style theta, ids from the default rule, `model.` prefixes and an embedding copy
    del raw["rope_theta"], raw["rope_scaling"], raw["dflash_config"]["target_layer_ids"]
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    (out / "config.json").write_text(json.dumps(raw))
    weights = {f"model.{k}": v for k, v in load_file(str(out / "model.safetensors")).items()}
    weights["model.embed_tokens.weight"] = torch.zeros(64, 32)
    save_file(weights, str(out / "model.safetensors"))
    loaded = load_drafter(out)
    assert loaded.config.target_layer_ids == cfg.target_layer_ids  # default rule, L=10, K=2
    torch.testing.assert_close(_block_logits(loaded, frozen, batch), _block_logits(model, frozen, batch))
    del weights["model.norm.weight"]
    save_file(weights, str(out / "model.safetensors"))
    with pytest.raises(ShardError, match=r"missing \['norm.weight'\]"):
        load_drafter(out)
    del raw["dflash_config"]["mask_token_id"]
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="mask_token_id"):
        load_drafter(out)


def test_automodel_matches_with_linear_rope_scaling(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    cfg = DrafterConfig.from_target_config(
        {**TARGET, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        mask_token_id=60,
        num_hidden_layers=1,
        block_size=4,
    )
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    model = DFlashDrafter(cfg).eval()
    frozen = FrozenTarget(torch.randn(64, 32), torch.randn(64, 32), TARGET, 60)
    seq = SequenceInput(torch.randint(0, 59, (40,)), torch.ones(40, dtype=torch.bool), torch.randn(40, 32))
    batch = make_packed_batch(
        [seq], block_size=4, mask_token_id=60, num_anchors=1, anchors=[torch.tensor([33])]
    )
    out = export_drafter(model, cfg, tmp_path / "lin", dtype=torch.float32)
    assert load_drafter(out).config.rope_scaling == cfg.rope_scaling
    hf = transformers.AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = hf(
            position_ids=torch.arange(37)[None],
            noise_embedding=frozen.embed(batch.block_ids[0])[None],
            target_hidden=seq.features[:33][None],
        )
    torch.testing.assert_close(
        frozen.logits(hidden[0]), _block_logits(model, frozen, batch)[0], atol=1e-4, rtol=1e-4
    )
