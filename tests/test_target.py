"""Target loading, truncation, layer capture and the frozen target parts, on tiny random Qwen targets."""

from __future__ import annotations

import json

import pytest
import torch
from dflash.extract.target import check_capture_ids, load_target
from dflash.extract.target_parts import read_frozen, write_target_parts
from dflash.shards.errors import ShardError
from dflash.shards.layers import default_layer_ids
from dflash.shards.target_config import read_target_config
from dflash.shards.target_parts import FROZEN_NAME, read_target_parts
from safetensors import safe_open

from tests.common.targets import KINDS, load_reference, make_target, reference_layer_outputs


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("targets")
    return {kind: make_target(root, kind) for kind in KINDS}


def _right_padded(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (len(lengths), max(lengths)), generator=g)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
        ids[b, n:] = 0
    return ids, mask


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
@pytest.mark.parametrize("kind", KINDS)
def test_captured_layers_equal_unpadded_reference(targets: dict, kind: str, masked: bool) -> None:
    """Right-padded rows give each row's own outputs, with or without a mask (extraction runs without)."""
    path = targets[kind]
    layer_ids = [0, 1, 2]  # the reference cannot give the last layer's raw output, see below
    target = load_target(path, layer_ids)
    assert len(target.decoder.layers) == 3  # truncated after the last captured layer
    reference = load_reference(path)
    lengths = [13, 5, 9, 1]
    ids, mask = _right_padded(lengths, seed=1)
    outs = target.capture(ids, mask if masked else None)
    assert [tuple(o.shape) for o in outs] == [(4, 13, 64)] * 3
    for b, n in enumerate(lengths):
        expected = reference_layer_outputs(reference, ids[b, :n], layer_ids)
        for k in range(3):
            diff = (outs[k][b, :n] - expected[k]).abs().max().item()
            # fp32 summation order differs between a padded batch and one row (~1e-5 in the DeltaNet scan,
            # transformers 5.24); a leak across rows or from padding shows up as > 1e-2.
            assert diff <= 5e-5, f"{kind} row {b} layer {layer_ids[k]}: max abs diff {diff}"
    # Outputs are real layer outputs, not the embeddings or each other.
    assert (outs[0] - outs[2]).abs().max() > 1e-2


class _Broken(torch.nn.Module):
    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("simulated compiler failure")


def test_failed_compiled_forward_falls_back_to_eager(targets: dict, caplog) -> None:
    """A compiled part that fails is swapped back for the original: one warning, the same outputs."""
    target = load_target(targets["qwen3"], [0, 2])
    ids, _ = _right_padded([9, 4], seed=3)
    expected = [o.clone() for o in target.capture(ids)]
    layer = target.decoder.layers[1]
    original = layer.mlp
    layer.mlp = _Broken()  # what speed_up(compile=True) does on CUDA, with a compiled part that fails
    target._compiled.append((layer, "mlp", original))
    with caplog.at_level("WARNING"):
        outs = target.capture(ids)
    assert "compiled forward failed (RuntimeError: simulated compiler failure)" in caplog.text
    assert layer.mlp is original and not target._compiled
    assert target.speed_up(compile=True) == []  # never compiled again in this process (and CPU anyway)
    for got, want in zip(outs, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="simulated"):  # without compiled parts, errors propagate
        layer.mlp = _Broken()
        target.capture(ids)


def test_speed_up_changes_nothing_on_cpu(targets: dict) -> None:
    target = load_target(targets["qwen3_5"], [1])
    mlp = target.decoder.layers[0].mlp
    assert target.speed_up(compile=True) == []
    assert target.decoder.layers[0].mlp is mlp


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_last_layer_is_raw_output_not_final_norm(targets: dict, kind: str) -> None:
    """Capturing the full model's last layer gives the layer output; HF's last hidden state is normed."""
    path = targets[kind]
    target = load_target(path, [3])
    reference = load_reference(path)
    ids, mask = _right_padded([7], seed=2)
    (out,) = target.capture(ids, mask)
    with torch.inference_mode():
        hs = reference.model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
        layers = reference.model.layers
        expected = layers[3](
            hs[3],
            position_embeddings=reference.model.rotary_emb(hs[3], torch.arange(7)[None]),
            attention_mask=None,
            position_ids=torch.arange(7)[None],
        )
    expected = expected[0] if isinstance(expected, tuple) else expected
    assert (out[0] - expected[0]).abs().max() <= 1e-5
    assert (out[0] - hs[-1][0]).abs().max() > 1e-3  # hs[-1] is the final-norm output


def test_vlm_wrapped_qwen3_5_loads_text_only_with_checkpoint_weights(targets: dict) -> None:
    from safetensors.torch import load_file

    path = targets["qwen3_5"]
    info = read_target_config(path)
    assert (info.model_type, info.decoder["model_type"], info.num_hidden_layers, info.hidden_size) == (
        "qwen3_5",
        "qwen3_5_text",
        4,
        64,
    )
    target = load_target(path, [1])
    assert type(target.model).__name__ == "Qwen3_5ForCausalLM"
    assert len(target.decoder.layers) == 2
    stored = load_file(str(path / "model.safetensors"))
    for name, p in target.decoder.named_parameters():
        assert torch.equal(p, stored[f"model.language_model.{name}"]), name


def test_moe_loads_truncated(targets: dict) -> None:
    target = load_target(targets["qwen3_moe"], [0, 1])
    assert len(target.decoder.layers) == 2
    ids, mask = _right_padded([6, 3], seed=3)
    outs = target.capture(ids, mask)
    assert all(torch.isfinite(o).all() for o in outs)


def test_bf16_load_and_hooks_removed(targets: dict) -> None:
    target = load_target(targets["qwen3"], [1], dtype=torch.bfloat16)
    assert target.dtype == torch.bfloat16
    ids, mask = _right_padded([4], seed=4)
    assert target.capture(ids, mask)[0].dtype == torch.bfloat16
    target.close()
    assert not target.decoder.layers[1]._forward_hooks


def test_bad_layer_ids_and_paths(targets: dict, tmp_path) -> None:
    with pytest.raises(ValueError, match="outside"):
        load_target(targets["qwen3"], [4])
    with pytest.raises(ValueError, match="increasing"):
        check_capture_ids([2, 1], 4)
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        read_target_config(tmp_path)


def test_default_layer_ids_match_dflash_rule() -> None:
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(64, 1) == [32]
    with pytest.raises(ValueError):
        default_layer_ids(36, 0)


@pytest.mark.parametrize(
    "kind,tie", [("qwen3", False), ("qwen3", True), ("qwen3_5", False), ("qwen3_5", True)]
)
def test_frozen_parts_from_checkpoint(tmp_path, kind: str, tie: bool) -> None:
    from safetensors.torch import load_file

    path = make_target(tmp_path / "t", kind, tie=tie)
    stored = load_file(str(path / "model.safetensors"))
    prefix = "model.language_model." if kind == "qwen3_5" else "model."
    stored_embed = stored[prefix + "embed_tokens.weight"]
    stored_head = stored_embed if tie else stored["lm_head.weight"]
    files = write_target_parts(tmp_path / "cache", path)
    parts = tmp_path / "cache" / "target"
    assert sorted(files) == sorted(p.name for p in parts.iterdir())  # each file's digest, for the manifest
    assert (parts / "config.json").read_bytes() == (path / "config.json").read_bytes()
    assert json.loads((parts / "tokenizer_config.json").read_text())["eos_token"] == "</s>"
    assert (parts / "tokenizer.json").is_file()
    with safe_open(parts / FROZEN_NAME, framework="pt") as f:  # a tied target stores its one matrix once
        assert sorted(f.keys()) == (
            ["embed_tokens.weight", "final_norm.gain"]
            if tie
            else ["embed_tokens.weight", "final_norm.gain", "lm_head.weight"]
        )
    read = read_target_parts(tmp_path / "cache")
    assert read.embed.dtype == torch.bfloat16 and read.tied == tie
    assert torch.equal(read.embed, stored_embed.to(torch.bfloat16))
    assert torch.equal(read.lm_head, stored_head.to(torch.bfloat16))
    # Idempotent: a second call given the digests keeps the directory (the weights are not read again).
    inode = (parts / FROZEN_NAME).stat().st_ino
    assert write_target_parts(tmp_path / "cache", path, recorded=files) == files
    assert (parts / FROZEN_NAME).stat().st_ino == inode
    assert not list((tmp_path / "cache").glob(".target.tmp-*"))


def test_frozen_parts_from_sharded_checkpoint(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    path = make_target(tmp_path / "t", "qwen3")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    _, head = read_frozen(sharded)
    assert torch.equal(head, model.lm_head.weight.to(torch.bfloat16))


def test_frozen_parts_missing_lm_head_untied_is_an_error(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    path = make_target(tmp_path / "t", "qwen3")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ShardError, match="no lm_head"):
        read_frozen(path)


@pytest.mark.parametrize("kind", KINDS)
def test_cached_last_layer_gives_the_targets_logits(tmp_path, kind: str) -> None:
    """Distillation's teacher: the stored final-norm gain turns the last layer's raw output into the target's
    own logits, for norms that scale by weight (qwen3) and by 1 + weight (qwen3_next, qwen3_5)."""
    from dflash.train.frozen import FrozenTarget

    path = make_target(tmp_path / "t", kind)
    model = load_reference(path)
    text = model.model.language_model if hasattr(model.model, "language_model") else model.model
    with torch.no_grad():  # a gain far from 1, so weight and 1 + weight give different logits
        text.norm.weight.copy_(torch.linspace(-0.5, 0.8, text.norm.weight.numel()))
    model.save_pretrained(path)
    write_target_parts(tmp_path / "cache", path)
    parts = read_target_parts(tmp_path / "cache")
    frozen = FrozenTarget(
        parts.embed.float(), parts.lm_head.float(), parts.config.raw, 0, parts.final_norm_gain
    )
    captured = {}
    text.layers[-1].register_forward_hook(
        lambda _m, _i, out: captured.update(h=out[0] if isinstance(out, tuple) else out)
    )
    ids = torch.randint(0, 200, (1, 12))
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False).logits[0]
    ours = frozen.logits(frozen.final_norm(captured["h"].reshape(12, -1)))
    # bf16 tables (as cached) against the fp32 model: close, and far from the wrong norm's logits
    assert torch.allclose(ours, logits, atol=0.05, rtol=0.05), (ours - logits).abs().max()
    wrong = FrozenTarget(frozen.embed_weight, frozen.lm_head_weight, {}, 0, parts.final_norm_gain - 1)
    assert not torch.allclose(
        wrong.logits(wrong.final_norm(captured["h"].reshape(12, -1))), logits, atol=0.05
    )
