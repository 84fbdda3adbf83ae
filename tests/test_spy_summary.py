"""`bench/spy_summary.py`: a py-spy raw profile split by part of the training step and thread business."""

from __future__ import annotations

from pathlib import Path

from bench.spy_summary import gil_shares, part_of, read_raw, summarize

RAW = """\
thread (7): MainThread;fit (train/trainer.py:314);train_step (train/trainer.py:215);drafter_loss (train/loss.py:289);DFlashDrafter.forward (train/model.py:363);compile_wrapper (torch/_dynamo/eval_frame.py:1024);_compile (torch/_dynamo/convert_frame.py:729) 30
thread (7): MainThread;fit (train/trainer.py:314);train_step (train/trainer.py:215);drafter_loss (train/loss.py:289);DFlashDrafter.forward (train/model.py:363);Runner.call (c1.py:3) 50
thread (7): MainThread;fit (train/trainer.py:314);train_step (train/trainer.py:214);build_attention_mask (train/mask.py:265);KeyIntervals.of (train/block_mask.py:50) 12
thread (7): MainThread;fit (train/trainer.py:314);train_step (train/trainer.py:224);Tensor.backward (torch/_tensor.py:631);_engine_run_backward (torch/autograd/graph.py:869) 25
thread (7): MainThread;fit (train/trainer.py:314) 3
thread (9): dflash-decode_0;_worker (concurrent/futures/thread.py:89) 60
thread (9): dflash-decode_0;_worker (concurrent/futures/thread.py:94);zstd_decompress_exact (shards/codec_base.py:111) 40
thread (11) 100
"""


def test_training_thread_splits_by_the_innermost_part_and_threads_by_their_waits(tmp_path: Path) -> None:
    path = tmp_path / "spy_raw.txt"
    path.write_text(RAW + "a line that is not a stack\n")
    stacks = read_raw(path)
    assert (
        len(stacks) == 8
        and stacks[0][0] == "thread (7): MainThread"
        and stacks[-1] == ("thread (11)", [], 100)
    )
    s = summarize(stacks)
    # a compile inside the forward counts as compiling; the forward's own launches as the forward
    assert s["main"] == {
        "dynamo compile (recompiles)": 30,
        "drafter forward (compiled regions)": 50,
        "block mask": 12,
        "backward": 25,
        "other": 3,
    }
    assert s["total"]["thread (9): dflash-decode_0"] == 100
    assert s["threads"]["thread (9): dflash-decode_0"] == 40  # the pool's idle worker loop is waiting
    assert s["threads"]["thread (11)"] == 0  # no Python frame: native, counted as waiting
    assert s["threads"]["thread (7): MainThread"] == 120


def test_a_stack_outside_every_part_is_other() -> None:
    assert part_of(["main (x.py:1)", "helper (y.py:2)"]) == "other"
    assert (
        part_of(["f (train/loss.py:1)", "linear_cross_entropy (train/loss.py:206)"]) == "loss (lm_head + CE)"
    )


def test_gil_shares_divide_each_threads_gil_samples_by_its_ticks(tmp_path: Path) -> None:
    every = tmp_path / "spy_raw.txt"
    every.write_text(RAW)
    holding = tmp_path / "spy_gil.txt"
    holding.write_text(
        "thread (7): MainThread;fit (train/trainer.py:314);train_step (train/trainer.py:215) 48\n"
        "thread (7): MainThread;fit (train/trainer.py:314) 12\n"
        "thread (9): dflash-decode_0;_worker (concurrent/futures/thread.py:94) 30\n"
    )
    shares = gil_shares(read_raw(every), read_raw(holding))
    # MainThread was sampled 120 times in the --idle profile and held the GIL in 60 of them
    assert shares == {
        "thread (7): MainThread": 0.5,
        "thread (9): dflash-decode_0": 0.3,
        "thread (11)": 0.0,
    }
