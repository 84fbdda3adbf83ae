"""`bench/simulate_codec.py`: a lossless cache of what another codec's decode (directly, or of layer deltas)
gives, for training a drafter on a codec before its format exists."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from common.synth import make_cache
from dflash.shards import Cache
from dflash.shards.codecs import get_codec

from bench import simulate_codec


def _layers(cache: Path) -> dict[int, list[torch.Tensor]]:
    with Cache.open(cache) as c:
        assert c.codec.name == "lossless"
        return {e.row: [c.read(e.row).hidden[layer] for layer in c.layers] for e in c.entries()}


@pytest.mark.parametrize("name", ["q4", "q6", "fp8"])
def test_a_codecs_simulated_cache_holds_its_decode_bit_for_bit(tmp_path: Path, name: str) -> None:
    # several rows a batch, each its own channel statistics: the batched round trip must be each row's own
    written = make_cache(tmp_path / "src", [40, 7, 90, 33, 12], layers=(1, 2, 3), hidden=64)
    argv = [str(tmp_path / "src"), str(tmp_path / name), "--codec", name, "--threads", "1"]
    assert simulate_codec.main(argv) == 0
    codec = get_codec(name)
    for row, layers in _layers(tmp_path / name).items():
        for x, y in zip(written[row], layers, strict=True):
            expected = codec.decode(codec.encode(x), tuple(x.shape), "bfloat16")
            assert torch.equal(y, expected) and not torch.equal(y, x)


def test_layer_deltas_decode_each_layer_from_the_reconstruction_below_it(tmp_path: Path) -> None:
    written = make_cache(tmp_path / "src", [40, 7, 90], layers=(1, 2, 3), hidden=64)
    argv = [str(tmp_path / "src"), str(tmp_path / "d"), "--codec", "q4", "--layer-delta", "--threads", "1"]
    assert simulate_codec.main(argv) == 0
    q4 = get_codec("q4")
    for row, layers in _layers(tmp_path / "d").items():
        rec = None
        for x, y in zip(written[row], layers, strict=True):
            x = x.float()
            target = x if rec is None else x - rec
            d = q4.decode(q4.encode(target.bfloat16()), tuple(x.shape), "bfloat16").float()
            rec = d if rec is None else rec + d
            assert torch.equal(y, rec.bfloat16())


def test_a_quantized_source_is_refused_in_one_line(tmp_path: Path) -> None:
    make_cache(tmp_path / "src", [10, 12], codec="fp8")
    with pytest.raises(SystemExit, match=r"^error: .*src is a fp8 cache; this needs exact states"):
        simulate_codec.main([str(tmp_path / "src"), str(tmp_path / "out")])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_layer_deltas_simulated_on_a_gpu_hold_the_cpus_bits(tmp_path: Path) -> None:
    # bench/jobs/layer_delta.sh simulates on the device's GPU: the cache must be the one the CPU writes
    make_cache(tmp_path / "src", [40, 7, 90, 33], layers=(1, 2, 3), hidden=64)
    for device in ("cpu", "cuda"):
        argv = [str(tmp_path / "src"), str(tmp_path / device), "--layer-delta", "--device", device]
        assert simulate_codec.main(argv) == 0
    cpu, cuda = _layers(tmp_path / "cpu"), _layers(tmp_path / "cuda")
    assert cpu.keys() == cuda.keys()
    for row, layers in cpu.items():
        assert all(torch.equal(a, b) for a, b in zip(layers, cuda[row], strict=True))
