"""The compiled training path: same math as eager, one graph for all layers, eager fallback, the loss epilogue.

torch.compile runs here with the `aot_eager` backend (Dynamo + AOTAutograd, no code generation): seconds on a
CPU, and it exercises everything but Inductor's kernels (those are checked on a GPU by the step bench).
"""

from __future__ import annotations

import logging

import dflash.train.loss as loss_module
import pytest
import torch
from dflash.train.blocks import SequenceInput, make_packed_batch
from dflash.train.compiled import CompiledOrEager, regions_backend, speed_up
from dflash.train.drafter_config import DrafterConfig
from dflash.train.frozen import FrozenTarget
from dflash.train.loss import chunk_bounds, chunk_terms, drafter_loss
from dflash.train.mask import build_attention_mask
from dflash.train.model import EAGER_REGIONS, DFlashDrafter, Regions

from tests.common.tiny_shapes import tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TARGET = tiny_target()


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _setup(layers=3, seed=0, lengths=(30, 12)):
    torch.manual_seed(seed)
    cfg = DrafterConfig.from_target_config(
        TARGET, mask_token_id=63, num_hidden_layers=layers, block_size=4, target_layer_ids=[1, 4]
    )
    frozen = FrozenTarget(torch.randn(64, 32), torch.randn(64, 32), TARGET, 63)
    gen = torch.Generator().manual_seed(seed)
    seqs = [
        SequenceInput(
            torch.randint(0, 60, (s,), generator=gen), torch.ones(s, dtype=torch.bool), torch.randn(s, 64)
        )
        for s in lengths
    ]
    batch = make_packed_batch(
        seqs, block_size=4, mask_token_id=63, num_anchors=5, generator=gen, pad_blocks_to_multiple=4
    )
    return DFlashDrafter(cfg), frozen, batch


def _step(model, frozen, batch):
    model.zero_grad()
    loss, stats = drafter_loss(model, frozen, batch, attn_mask=build_attention_mask(batch), normalizer=7.5)
    loss.backward()
    return loss.detach(), stats, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_compiled_regions_match_eager_and_share_one_graph_across_layers(fresh_dynamo) -> None:
    model, frozen, batch = _setup()
    loss, stats, grads = _step(model, frozen, batch)
    assert speed_up(model, "on", backend="aot_eager")
    assert regions_backend(model) == "aot_eager" and isinstance(
        model.regions.attention_inputs, CompiledOrEager
    )
    torch._dynamo.utils.counters.clear()
    c_loss, c_stats, c_grads = _step(model, frozen, batch)
    assert torch.equal(c_loss, loss)
    assert c_stats.summary() == stats.summary()
    for name, grad in grads.items():
        torch.testing.assert_close(c_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    # fuse_features, final_norm, the loss epilogue, the output/MLP region once and the attention-input
    # region twice (layer 0's input is the frozen embedding, which needs no gradient: a grad there would cost
    # matmuls); with a graph per layer it would be 9 or more, and 7 before the output/MLP region was shared.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 6
    assert all(r.failure is None for r in (model.regions.attention_inputs, model.regions.fuse_features))
    # The same model state_dict keys as an uncompiled drafter: checkpoints and export do not change.
    assert set(model.state_dict()) == set(_setup()[0].state_dict())


def test_packs_of_other_shapes_reuse_the_first_steps_graphs(fresh_dynamo) -> None:
    """Token axes are dynamic from the first call: a pack with other numbers of blocks and context tokens
    compiles nothing new (without the marks, Dynamo compiles every region a second time at step 2)."""
    model, frozen, batch = _setup(layers=2)
    speed_up(model, "on", backend="aot_eager")
    torch._dynamo.utils.counters.clear()
    _step(model, frozen, batch)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for seed in (1, 2):
        other = _setup(layers=2, seed=seed, lengths=(41, 17, 9) if seed == 1 else (50,))[2]
        assert other.num_blocks != batch.num_blocks and other.num_context_tokens != batch.num_context_tokens
        _step(model, frozen, other)
    assert graphs > 0 and torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_evaluation_without_grad_stays_eager() -> None:
    model, frozen, batch = _setup(layers=1)

    def refuse(*_args):
        raise AssertionError("a compiled region ran under no_grad")

    model.regions = Regions(refuse, refuse, refuse, refuse, backend="aot_eager")
    with torch.no_grad():
        out = model(batch, frozen.embed(batch.block_ids), build_attention_mask(batch))
    assert out.shape == (batch.num_blocks, 4, 32)


def test_speed_up_modes() -> None:
    model, _, _ = _setup(layers=1)
    assert not speed_up(model, "auto") and model.regions is EAGER_REGIONS  # CPU: auto means eager
    assert not speed_up(model, "off") and regions_backend(model) is None
    with pytest.raises(ValueError, match="'fast'"):
        speed_up(model, "fast")
    wrapped = torch.nn.Module()
    wrapped.module = model  # what DDP looks like to regions_backend
    assert speed_up(model, "on", backend="aot_eager") and regions_backend(wrapped) == "aot_eager"


def test_a_region_that_fails_to_compile_warns_once_and_runs_eagerly(fresh_dynamo, caplog) -> None:
    calls = []

    def broken_backend(gm, _inputs):
        calls.append(1)
        raise RuntimeError("no kernel for you\nsecond line")

    def double(x):
        return x * 2

    region = CompiledOrEager(double, "test region", backend=broken_backend)
    with caplog.at_level(logging.WARNING):
        assert torch.equal(region(torch.ones(3)), torch.full((3,), 2.0))
        assert torch.equal(region(torch.ones(3)), torch.full((3,), 2.0))
    assert calls == [1] and "no kernel for you" in region.failure and "second line" not in region.failure
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1

    def out_of_memory(gm, _inputs):
        raise torch.OutOfMemoryError("oom")

    with pytest.raises(torch.OutOfMemoryError):  # never hidden behind a fallback that needs more memory
        CompiledOrEager(double, "oom region", backend=out_of_memory)(torch.ones(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("need_grad", [True, False])
def test_compilable_loss_terms_equal_the_in_place_ones_bit_for_bit(dtype, need_grad) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(37, 300, generator=gen) * 4).to(dtype)
    labels = torch.randint(0, 300, (37,), generator=gen)
    scale = torch.rand(37, generator=gen) * (torch.rand(37, generator=gen) > 0.2)
    mine = chunk_terms(logits, labels, scale, need_grad)
    theirs = loss_module._chunk_terms_in_place(logits.clone(), labels, scale, need_grad)
    for a, b in zip(mine, theirs, strict=True):
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))


def test_auto_chunks_are_equal_and_bounded() -> None:
    vocab = 151_936
    bounds = chunk_bounds(7680, vocab, None)  # one Qwen3-8B step: 512 blocks x 15 drafted slots
    sizes = {end - start for start, end in bounds}
    assert bounds[0][0] == 0 and bounds[-1][1] == 7680 and len(sizes) == 1
    assert max(sizes) * vocab <= loss_module.LOGIT_CHUNK_ELEMENTS
    assert chunk_bounds(5000, 512, None) == [(0, 5000)]  # a small vocabulary: one chunk
    assert chunk_bounds(10, 512, 4) == [(0, 4), (4, 8), (8, 10)]  # explicit sizes as before
    assert all(
        e - s <= -(-100 // 3) for s, e in chunk_bounds(100, loss_module.LOGIT_CHUNK_ELEMENTS // 34, None)
    )


def test_compile_setting_reaches_the_config_and_a_resume_may_change_it() -> None:
    from dflash.shards import Manifest
    from dflash.train.cli import build_config
    from dflash.train.resume_checks import cache_identity, check_resume

    on = build_config(["--cache", "c", "--out", "o"])
    off = build_config(["--cache", "c", "--out", "o", "--no-compile"])
    assert on.compile is True and off.compile is False and off.to_flat()["compile"] is False
    model, _, _ = _setup(layers=1)
    assert not speed_up(model, off.compile) and not speed_up(model, on.compile)  # a CPU: eager either way
    # A kernel choice, not the trajectory: runs from before the setting existed resume, and may flip it.
    manifest = Manifest(complete=True, target={}, layers=[1], hidden_size=32, codec={}, dataset={}, options={},
                        plan={}, shards=[])  # fmt: skip
    saved = {"config": {k: v for k, v in off.to_flat().items() if k != "compile"}, **cache_identity(manifest)}
    check_resume(saved, on.to_flat(), manifest)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inductor_compiled_step_matches_eager_on_gpu(fresh_dynamo) -> None:
    # Real kernels: Inductor's Triton code for the regions and the loss epilogue, FlexAttention on the
    # layout BlockMask (the batch is large enough for "auto" to pick it). fp32 without TF32.
    torch.backends.cuda.matmul.allow_tf32 = False
    model, frozen, _ = _setup(layers=2)
    gen = torch.Generator().manual_seed(3)
    seqs = [
        SequenceInput(
            torch.randint(0, 60, (s,), generator=gen), torch.ones(s, dtype=torch.bool), torch.randn(s, 64)
        )
        for s in (1500, 900)
    ]
    batch = make_packed_batch(seqs, block_size=4, mask_token_id=63, num_anchors=600, generator=gen).to("cuda")
    model, frozen = model.cuda(), frozen.to("cuda")
    assert type(build_attention_mask(batch)).__name__ == "FlexMask"
    loss, stats, grads = _step(model, frozen, batch)
    assert speed_up(model, "auto")
    c_loss, c_stats, c_grads = _step(model, frozen, batch)
    torch.testing.assert_close(c_loss, loss, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(c_grads[name], grad, atol=1e-5, rtol=1e-3, msg=name)
    assert abs(c_stats.summary()["acc"] - stats.summary()["acc"]) < 1e-3
    assert all(getattr(model.regions, n).failure is None for n in ("attention_inputs", "final_norm"))
