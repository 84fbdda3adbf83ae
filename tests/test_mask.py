"""The attention mask: the rule itself, its effect on the model's block logits, and flex == dense."""

from __future__ import annotations

import logging
import warnings
from types import SimpleNamespace

import dflash.train.mask as mask_module
import pytest
import torch
from dflash.train.blocks import SequenceInput, make_packed_batch
from dflash.train.cli import build_config
from dflash.train.config import config_from_flat
from dflash.train.drafter_config import DrafterConfig
from dflash.train.frozen import FrozenTarget
from dflash.train.mask import DenseMask, FlexMask, build_attention_mask, choose_backend, dense_mask
from dflash.train.model import DFlashDrafter
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.common.tiny_shapes import tiny_target

TARGET = tiny_target()
B = 4
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _pack(lengths, num_anchors=3, seed=0, pad=1, k=2):
    gen = torch.Generator().manual_seed(seed)
    seqs = [
        SequenceInput(
            torch.randint(0, 60, (s,), generator=gen),
            torch.ones(s, dtype=torch.bool),
            torch.randn(s, 32 * k, generator=gen),
        )
        for s in lengths
    ]
    return seqs, make_packed_batch(
        seqs,
        block_size=B,
        mask_token_id=63,
        num_anchors=num_anchors,
        generator=gen,
        pad_blocks_to_multiple=pad,
    )


def _oracle(batch) -> torch.Tensor:
    t, m = batch.num_context_tokens, batch.num_blocks * B
    allowed = torch.zeros(m, t + m, dtype=torch.bool)
    for q in range(m):
        n = q // B
        s, a = int(batch.block_seq[n]), int(batch.anchor_pos[n])
        if s < 0:
            continue
        for kv in range(t):
            allowed[q, kv] = int(batch.context_seq[kv]) == s and int(batch.context_pos[kv]) < a
        allowed[q, t + n * B : t + (n + 1) * B] = True
    return allowed


@given(
    lengths=st.lists(st.integers(2, 12), min_size=1, max_size=3),
    anchors=st.integers(1, 5),
    pad=st.integers(1, 4),
    seed=st.integers(0, 1000),
)
@settings(max_examples=40, deadline=None)
def test_dense_mask_matches_a_literal_reading_of_the_rule(lengths, anchors, pad, seed) -> None:
    _, batch = _pack(lengths, anchors, seed, pad)
    assert torch.equal(dense_mask(batch), _oracle(batch))


def _model(seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = DrafterConfig.from_target_config(
        TARGET, mask_token_id=63, num_hidden_layers=2, block_size=B, target_layer_ids=[1, 4], **overrides
    )
    frozen = FrozenTarget(torch.randn(64, 32), torch.randn(64, 32), TARGET, 63)
    return DFlashDrafter(cfg).eval(), frozen


def _logits(model, frozen, batch, backend="dense"):
    attn_mask = build_attention_mask(batch, backend) if isinstance(backend, str) else backend
    with torch.no_grad():
        hidden = model(batch, frozen.embed(batch.block_ids), attn_mask)
    return frozen.logits(hidden)


def _with(batch, **changes):
    moved = batch.to("cpu")
    for name, value in changes.items():
        setattr(moved, name, value)
    return moved


def test_features_at_or_after_the_anchor_do_not_leak_into_its_block() -> None:
    model, frozen = _model()
    _, batch = _pack([24, 17], num_anchors=4)
    base = _logits(model, frozen, batch)
    for n in range(batch.num_blocks):
        s, a = int(batch.block_seq[n]), int(batch.anchor_pos[n])
        mine = batch.context_seq == s
        later = mine & (batch.context_pos >= a)  # includes position a itself: `<`, not `<=`
        earlier = mine & (batch.context_pos < a)
        features = batch.features.clone()
        features[later] += 5 * torch.randn_like(features[later])
        torch.testing.assert_close(_logits(model, frozen, _with(batch, features=features))[n], base[n])
        if earlier.any():
            features = batch.features.clone()
            features[earlier] += 5 * torch.randn_like(features[earlier])
            assert (_logits(model, frozen, _with(batch, features=features))[n] - base[n]).abs().max() > 1e-3
        at_anchor = batch.features.clone()
        at_anchor[mine & (batch.context_pos == a)] += 10.0
        torch.testing.assert_close(_logits(model, frozen, _with(batch, features=at_anchor))[n], base[n])


def test_other_blocks_and_other_sequences_have_no_influence() -> None:
    model, frozen = _model(1)
    _, batch = _pack([20, 15], num_anchors=3)
    base = _logits(model, frozen, batch)
    first = int((batch.block_seq == 1).nonzero()[0])
    # Change sequence 1 entirely (features and block tokens): sequence 0's blocks must not move.
    features = batch.features.clone()
    features[batch.context_seq == 1] = torch.randn_like(features[batch.context_seq == 1])
    ids = batch.block_ids.clone()
    ids[first:, 0] = (ids[first:, 0] + 1) % 60
    changed = _logits(model, frozen, _with(batch, features=features, block_ids=ids))
    torch.testing.assert_close(changed[:first], base[:first])
    assert (changed[first:] - base[first:]).abs().max() > 1e-3
    # Change one block's anchor token: only that block moves, both directions inside it.
    ids = batch.block_ids.clone()
    ids[1, 0] = (ids[1, 0] + 7) % 60
    changed = _logits(model, frozen, _with(batch, block_ids=ids))
    keep = torch.ones(batch.num_blocks, dtype=torch.bool)
    keep[1] = False
    torch.testing.assert_close(changed[keep], base[keep])
    assert ((changed[1] - base[1]).abs().amax(-1) > 1e-3).all()  # every slot of the block, slot 0 included


def _quiet_flex():
    warnings.filterwarnings("ignore", message=".*flex_attention.*")


def test_flex_attention_equals_dense_on_cpu_eager() -> None:
    _quiet_flex()
    model, frozen = _model(2)
    _, batch = _pack([40, 9, 30], num_anchors=6, pad=8)
    dense = _logits(model, frozen, batch, "dense")
    try:
        flex = _logits(model, frozen, batch, "flex")
    except Exception as exc:  # pragma: no cover - depends on the torch build
        pytest.skip(f"flex_attention does not run on this CPU build: {exc}")
    torch.testing.assert_close(flex, dense, atol=1e-4, rtol=1e-4)
    padding = batch.block_seq < 0
    assert padding.any()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flex_attention_equals_dense_on_gpu_forward_and_backward() -> None:
    # Inductor's FlexAttention needs head_dim >= 16 (H200, torch 2.11: "NYI ... at least 16 but got E=8").
    model, frozen = _model(3, head_dim=16)
    model = model.cuda().train()
    frozen = frozen.to("cuda")
    _, batch = _pack([300, 170], num_anchors=37, pad=8)  # 74 blocks + 6 padding blocks
    batch = batch.to("cuda")
    outs, grads = [], []
    for backend in ("dense", "flex"):
        model.zero_grad()
        hidden = model(batch, frozen.embed(batch.block_ids), build_attention_mask(batch, backend))
        (hidden[batch.block_seq >= 0].float().square().mean()).backward()
        outs.append(hidden.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    # Loose enough for TF32 inside the kernels; a mask error moves outputs by O(1).
    torch.testing.assert_close(outs[1], outs[0], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(grads[1], grads[0], atol=2e-3, rtol=2e-2)


def test_padding_blocks_see_nothing_and_stay_finite() -> None:
    model, frozen = _model(4)
    model.train()
    _, batch = _pack([10], num_anchors=2, pad=4)
    mask = build_attention_mask(batch, "dense")
    assert not dense_mask(batch)[batch.block_seq.repeat_interleave(B) < 0].any()
    hidden = model(batch, frozen.embed(batch.block_ids), mask)
    hidden.float().sum().backward()  # padding rows included: no NaN may reach the weights
    assert torch.isfinite(hidden).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


# --- choosing the implementation, and falling back when FlexAttention fails ---------------------------


def _shape_only(num_blocks: int, context: int, device: str = "cuda") -> SimpleNamespace:
    # choose_backend reads only shapes and the device, so a CUDA batch can be described without a GPU.
    return SimpleNamespace(
        num_blocks=num_blocks,
        block_size=B,
        num_context_tokens=context,
        block_seq=SimpleNamespace(device=torch.device(device)),
    )


@pytest.fixture
def flex_state(monkeypatch):
    """A process in which FlexAttention has not failed yet (restored afterwards)."""
    monkeypatch.setattr(mask_module, "_flex_failures", {})
    return monkeypatch


def _failing_flex(calls: list, exc: BaseException):
    import torch._functorch.config  # not loaded by `import torch`; a test run alone has not loaded it yet

    def fail(*_args, **_kwargs):
        calls.append(torch._functorch.config.force_non_lazy_backward_lowering)
        raise exc

    return lambda _device: fail


def test_auto_uses_dense_for_small_batches_and_off_cuda_and_flex_for_large_ones(flex_state) -> None:
    limit = mask_module.AUTO_DENSE_MAX_PAIRS
    m = 2048  # 512 blocks of 4: the boundary falls at context = limit / m - m
    at_limit = limit // m - m
    assert choose_backend(_shape_only(m // B, at_limit)) == "dense"
    assert choose_backend(_shape_only(m // B, at_limit + 1)) == "flex"
    assert choose_backend(_shape_only(m // B, at_limit + 1, device="cpu")) == "dense"
    assert choose_backend(_shape_only(20, 300)) == "dense"  # the tiny preset's scale
    # A Qwen3-8B step: 512 anchors x 16 slots against a 3072-token sequence.
    assert choose_backend(SimpleNamespace(**{**vars(_shape_only(512, 3072)), "block_size": 16})) == "flex"
    # Explicit choices are taken as given, whatever the size or device.
    assert choose_backend(_shape_only(1, 1), "flex") == "flex"
    assert choose_backend(_shape_only(m // B, 10**6), "dense") == "dense"
    with pytest.raises(ValueError, match="'sparse'"):
        choose_backend(_shape_only(1, 1), "sparse")


def test_auto_falls_back_to_dense_once_with_one_warning_and_dense_numerics(flex_state, caplog) -> None:
    model, frozen = _model(5)
    _, batch = _pack([30, 12], num_anchors=5, pad=4)
    calls: list = []
    flex_state.setattr(
        mask_module, "_flex_attention", _failing_flex(calls, RuntimeError("lowering\nsecond-line-xyz"))
    )
    dense = _logits(model, frozen, batch, "dense")
    with caplog.at_level(logging.WARNING, logger=mask_module.__name__):
        fell_back = _logits(model, frozen, batch, FlexMask.from_batch(batch, fallback_to_dense=True))
        again = _logits(model, frozen, batch, FlexMask.from_batch(batch, fallback_to_dense=True))
    assert torch.equal(fell_back, dense) and torch.equal(again, dense)  # the dense path itself, bit for bit
    assert calls == [True]  # tried once (backward lowered eagerly so its errors surface), never retried
    warnings_seen = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings_seen) == 1
    assert (
        "RuntimeError: lowering" in warnings_seen[0].getMessage()
        and "second-line-xyz" not in warnings_seen[0].getMessage()
    )
    assert "dense" in warnings_seen[0].getMessage()
    assert mask_module.flex_failure() == "RuntimeError: lowering"
    # Later "auto" batches go straight to dense, even the large ones that would pick FlexAttention.
    assert choose_backend(_shape_only(4096, 10**5)) == "dense"
    assert choose_backend(_shape_only(4096, 10**5), "flex") == "flex"


def test_auto_falls_back_when_the_block_mask_cannot_be_built(flex_state, caplog) -> None:
    _, batch = _pack([16], num_anchors=3)
    flex_state.setattr(mask_module, "choose_backend", lambda _batch, _backend: "flex")

    def broken(cls, *_args, **_kwargs):
        raise TypeError("create_block_mask failed")

    flex_state.setattr(FlexMask, "from_batch", classmethod(broken))
    with caplog.at_level(logging.WARNING, logger=mask_module.__name__):
        built = build_attention_mask(batch, "auto")
    assert isinstance(built, DenseMask) and torch.equal(built.allowed, DenseMask.from_batch(batch).allowed)
    assert "TypeError: create_block_mask failed" in caplog.text
    with pytest.raises(TypeError):  # "flex" never falls back
        build_attention_mask(batch, "flex")


def test_a_fallback_stays_in_the_scope_where_flex_failed(flex_state) -> None:
    model, frozen = _model(5)
    _, batch = _pack([30, 12], num_anchors=5, pad=4)
    calls: list = []
    flex_state.setattr(mask_module, "_flex_attention", _failing_flex(calls, RuntimeError("walk shape")))
    large = _shape_only(4096, 10**5)
    with mask_module.flex_scope("decode walk"):
        fell_back = _logits(model, frozen, batch, FlexMask.from_batch(batch, fallback_to_dense=True))
        assert mask_module.flex_failure() == "RuntimeError: walk shape"
        assert choose_backend(large) == "dense"  # the walk's later masks skip the kernel that failed there
    assert torch.equal(fell_back, _logits(model, frozen, batch, "dense"))
    # Training, the default scope, keeps FlexAttention and tries it on its own.
    assert mask_module.flex_failure() is None and mask_module.flex_failure("train") is None
    assert choose_backend(large) == "flex"
    _logits(model, frozen, batch, FlexMask.from_batch(batch, fallback_to_dense=True))
    assert calls == [True, True] and mask_module.flex_failure() == "RuntimeError: walk shape"
    with mask_module.flex_scope("decode walk"):
        assert choose_backend(large) == "dense"


def test_flex_is_strict_and_out_of_memory_is_never_masked_by_a_fallback(flex_state) -> None:
    model, frozen = _model(6)
    _, batch = _pack([20], num_anchors=3)
    calls: list = []
    flex_state.setattr(mask_module, "_flex_attention", _failing_flex(calls, RuntimeError("kernel")))
    with pytest.raises(RuntimeError, match="kernel"):
        _logits(model, frozen, batch, "flex")
    assert mask_module.flex_failure() is None
    flex_state.setattr(mask_module, "_flex_attention", _failing_flex(calls, torch.OutOfMemoryError("oom")))
    with pytest.raises(torch.OutOfMemoryError):
        _logits(model, frozen, batch, FlexMask.from_batch(batch, fallback_to_dense=True))
    assert mask_module.flex_failure() is None


def test_attention_setting_reaches_the_train_config(tmp_path) -> None:
    cfg = build_config(["--cache", str(tmp_path), "--out", str(tmp_path / "run"), "--attention", "flex"])
    assert cfg.attention == "flex" and cfg.to_flat()["attention"] == "flex"
    assert build_config(["--cache", "c", "--out", "o"]).attention == "auto"
    with pytest.raises(ValueError, match="attention='sparse'"):
        config_from_flat({"cache": "c", "out": "o", "attention": "sparse"})


def test_the_forward_tile_reaches_flex_on_cuda_only_where_it_divides_the_mask_tile(monkeypatch) -> None:
    monkeypatch.setattr(mask_module, "_forward_tile", mask_module.FORWARD_TILE)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    rows, keys = mask_module.FORWARD_TILE
    tile = SimpleNamespace(BLOCK_SIZE=(2 * rows, keys))
    assert mask_module.kernel_options(tile, cuda) == {"BLOCK_M": rows, "BLOCK_N": keys}
    assert mask_module.kernel_options(tile, cpu) is None  # CPU kernels take no Triton tiles
    # a kernel tile must divide the BlockMask's: smaller masks (tests, --flex-tiles) keep Inductor's default
    assert mask_module.kernel_options(SimpleNamespace(BLOCK_SIZE=(rows // 2, keys)), cuda) is None
    assert mask_module.kernel_options(SimpleNamespace(BLOCK_SIZE=(rows, keys + 1)), cuda) is None
    mask_module.reset_flex(forward_tile=None)
    assert mask_module.kernel_options(tile, cuda) is None
    mask_module.reset_flex()
    assert mask_module.kernel_options(tile, cuda) == {"BLOCK_M": rows, "BLOCK_N": keys}
