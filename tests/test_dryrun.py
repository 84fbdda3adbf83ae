"""Layer rule, ExtractConfig checks, `dflash-extract --dry-run` output and one-line CLI errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from dflash.extract.cli import config_from_args, main
from dflash.extract.config import ColumnNames, ExtractConfig
from dflash.shards.codec_costs import CODEC_COSTS, CodecCost
from dflash.shards.layers import capture_layer_ids as resolve_layers
from dflash.shards.target_config import read_target_config

from tests.common.datasets import make_rows, write_save_to_disk, write_target_config

JSON_KEYS = {
    "rows",
    "rows_skipped",
    "tokens",
    "batches",
    "padded_tokens",
    "max_batch_tokens",
    "plan_seconds",
    "bytes_estimate",
    "supervised_tokens",
    "skipped",
    "padding_overhead",
    "free_bytes",
    "layers",
    "units",
}


@pytest.mark.parametrize(
    ("L", "K", "expected"),
    [
        (36, 5, [1, 9, 17, 25, 33]),
        (64, 5, [1, 16, 31, 46, 61]),
        (32, 5, [1, 8, 15, 22, 29]),
        (36, 1, [18]),
        (28, 3, [1, 13, 25]),
        (48, 4, [1, 16, 30, 45]),
    ],
)
def test_resolve_layers_default_rule(L, K, expected):
    assert resolve_layers(L, None, K) == expected
    assert resolve_layers(L, None, K) == sorted(
        {round(1 + i * (L - 4) / (K - 1)) for i in range(K)} if K > 1 else {L // 2}
    )


def test_resolve_layers_defaults_and_explicit():
    assert resolve_layers(36) == [1, 9, 17, 25, 33]  # K = 5 when nothing is given
    assert resolve_layers(4, "all") == [0, 1, 2, 3]
    assert resolve_layers(36, [17, 1, 9]) == [1, 9, 17]
    assert resolve_layers(4, None, 5) == [1]  # the rule repeats id 1 for tiny targets: captured once
    with pytest.raises(ValueError, match=r"layer ids \[36\] are outside \[0, 36\)"):
        resolve_layers(36, [1, 36])
    with pytest.raises(ValueError, match="needs a target of >= 4 layers"):
        resolve_layers(2, None, 3)
    with pytest.raises(ValueError, match="either layers or num_draft_layers"):
        resolve_layers(36, [1], 5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"codec": "gzip"}, "codec must be one of lossless, fp8, q6, q4; got 'gzip'"),
        ({"max_len": 0}, "max_len must be >= 1, got 0"),
        ({"overlong": "drop"}, "overlong must be one of truncate, skip"),
        ({"token_budget": 0}, "token_budget must be >= 1"),
        ({"layers": [1, -1]}, "layers must be layer ids >= 0"),
        ({"layers": [1], "num_draft_layers": 3}, "give either layers"),
        ({"layers": "some"}, "layers must be a list of layer ids or 'all'"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"device": "tpu"}, "device must be"),
        ({"out": None}, "out is required"),
        ({"unit_bytes": 10}, "unit_bytes must be >= 1 MiB"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    base = {"target": "t", "dataset": "d", "out": "o"}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        ExtractConfig(**{**base, **kwargs})


def test_column_names_must_differ():
    with pytest.raises(ValueError, match="must differ"):
        ColumnNames(input_ids="x", loss_mask="x")


@pytest.fixture
def setup(tmp_path):
    rows = make_rows(120, seed=5, max_len=60, vocab=1000, empty=(0, 1), unsupervised=(2,))
    ds = write_save_to_disk(rows, tmp_path / "ds", num_files=2, rows_per_batch=10)
    target = write_target_config(
        tmp_path / "target", vocab_size=1000, wrapped=True, num_hidden_layers=64, hidden_size=5120
    )
    return rows, ds, target, tmp_path


def test_dry_run_json(setup, capsys):
    rows, ds, target, tmp_path = setup
    rc = main(
        [
            "--target",
            str(target),
            "--dataset",
            str(ds),
            "--out",
            str(tmp_path / "cache" / "new"),
            "--dry-run",
            "--json",
            "--max-len",
            "50",
            "--token-budget",
            "512",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out.keys() >= JSON_KEYS
    assert out["rows"] + out["rows_skipped"] == len(rows)
    assert out["skipped"]["empty"] == 2 and out["skipped"]["no_supervised_tokens"] >= 1
    assert out["layers"] == [1, 16, 31, 46, 61]
    assert out["target"]["hidden_size"] == 5120  # read from text_config of the VLM wrapper
    assert out["max_batch_tokens"] <= 512 and out["padded_tokens"] >= out["tokens"]
    assert set(out["bytes_estimate"]) == {"raw", "lossless", "fp8", "q6", "q4"}
    assert out["bytes_estimate"]["raw"] >= out["tokens"] * 5 * 5120 * 2
    est, table = out["bytes_estimate"], out["codecs"]
    assert list(table) == ["raw", "lossless", "fp8", "q6", "q4"]
    assert est["raw"] > est["lossless"] > est["fp8"] > est["q6"] > est["q4"]
    assert table["q6"]["bytes"] == est["q6"] and table["q6"]["tau"] == CODEC_COSTS["q6"].tau_text()
    assert table["q6"]["tau_delta"] is not None and 0.01 < table["q6"]["rel_error"] < 0.05
    assert table["q4"]["tau_delta"] is not None and 0.05 < table["q4"]["rel_error"] < 0.2
    # The default layers leave out the last one, which distillation reads: the dry run sizes adding it, one
    # layer's share of the chosen codec's estimate (5 layers -> 6).
    distill = out["distill"]
    assert distill["last_layer"] == 63 and not distill["cached"]
    assert out["codec"] == "lossless"
    one_layer = est["lossless"] / len(out["layers"])
    assert 0.8 * one_layer < distill["extra_bytes"] < 1.2 * one_layer
    assert not (tmp_path / "cache").exists()  # a dry run writes nothing


def test_dry_run_table(setup, capsys):
    _, ds, target, _ = setup
    assert main(["--target", str(target), "--dataset", str(ds), "--dry-run", "--codec", "fp8"]) == 0
    text = capsys.readouterr().out
    assert "`dflash-train --distill` needs the last layer (63): add it to --layers (+" in text
    assert main(["--target", str(target), "--dataset", str(ds), "--dry-run", "--layers", "1,63"]) == 0
    assert (
        "`dflash-train --distill` can use this cache: its last layer (63) is in it" in capsys.readouterr().out
    )
    for word in (
        "rows kept",
        "rows skipped",
        "empty 2",
        "supervised",
        "batches",
        "padding",
        "cache size",
        "fp8 *",
        "lossless",
        "free space",
        "tau vs lossless",
    ):
        assert word in text
    # every codec is measured on the quality benchmark: its figure and its seed count are shown
    for codec in ("q4", "fp8", "q6"):
        line = next(line for line in text.splitlines() if line.startswith(f"{codec} "))
        cost = CODEC_COSTS[codec]
        assert cost.tau_seeds >= 1 and f"({cost.tau_seeds} seed" in line and cost.tau_text() in line


def test_codec_cost_text_says_what_is_not_measured() -> None:
    """A codec without a quality-benchmark figure says so rather than showing a number; one seed has no range."""
    assert CodecCost(ratio=2.0, scale_bytes=0, rel_error=0.02).tau_text() == "not measured"
    one = CodecCost(ratio=2.0, scale_bytes=0, rel_error=0.02, tau_delta=-0.008, tau_seeds=1, tau_bench="CPU")
    assert one.tau_text() == "-0.8% (1 seed, CPU)"
    assert CodecCost(ratio=1.0, scale_bytes=0, rel_error=0.0).tau_text().startswith("0 (exact")


def test_bad_target_config_is_one_line(setup, capsys):
    _, ds, _, tmp_path = setup
    assert main(["--target", str(tmp_path / "none"), "--dataset", str(ds), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dflash-extract: error: {tmp_path / 'none' / 'config.json'}: no config.json")
    assert err.count("\n") == 1


def test_bad_data_error_is_one_line(setup, capsys):
    _, ds, _target, tmp_path = setup
    small = write_target_config(tmp_path / "small", vocab_size=10)
    assert main(["--target", str(small), "--dataset", str(ds), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "column 'input_ids': row" in err and "outside [0, 10)" in err and err.count("\n") == 1


def test_unknown_flag_is_one_line(capsys):
    assert main(["--target", "t", "--dataset", "d", "--bogus"]) == 2
    err = capsys.readouterr().err
    assert err == "dflash-extract: error: unrecognized arguments: --bogus (see dflash-extract --help)\n"


def test_layers_flag_and_exclusive_group(setup, capsys):
    _, ds, target, _ = setup
    assert (
        main(["--target", str(target), "--dataset", str(ds), "--dry-run", "--json", "--layers", "3,5"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["layers"] == [3, 5]
    assert main(["--target", "t", "--dataset", "d", "--layers", "1", "--num-draft-layers", "2"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_read_target_config_plain_and_wrapped(tmp_path):
    plain = read_target_config(write_target_config(tmp_path / "a", num_hidden_layers=36))
    wrapped = read_target_config(write_target_config(tmp_path / "b", num_hidden_layers=64, wrapped=True))
    assert (plain.model_type, plain.num_hidden_layers) == ("qwen3", 36)
    assert (wrapped.model_type, wrapped.num_hidden_layers) == ("qwen3_5", 64)


def test_cli_subprocess_no_traceback_and_no_torch(setup):
    """One fresh interpreter: a bad run prints one line (no traceback), a good one never imports torch."""
    _, ds, target, _ = setup
    code = (
        "import sys, dflash.shards.errors\n"
        "base = 'torch' in sys.modules\n"
        "from dflash.extract.cli import main\n"
        "bad = main(['--target', sys.argv[1], '--dataset', sys.argv[2] + '/missing', '--dry-run'])\n"
        "good = main(['--target', sys.argv[1], '--dataset', sys.argv[2], '--dry-run', '--json'])\n"
        "print(bad, good, base, 'torch' in sys.modules, file=sys.stderr)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(target), str(ds)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert "rows" in json.loads(run.stdout)
    error_line, status = run.stderr.strip().split("\n")
    assert error_line.startswith("dflash-extract: error: dataset not found")
    bad, good, shards_imports_torch, torch_loaded = status.split()
    assert (bad, good) == ("2", "0")
    if shards_imports_torch == "True":
        pytest.skip("dflash.shards/__init__ imports torch eagerly; the dry-run path cannot avoid it")
    assert torch_loaded == "False"


def test_compile_flag_defaults_on_and_can_be_turned_off() -> None:
    base = ["--target", "t", "--dataset", "d", "--out", "o"]
    assert config_from_args(base).compile is True
    assert config_from_args([*base, "--no-compile"]).compile is False


def test_work_units_are_sized_by_the_dtype_the_run_computes_in(setup):
    """float32 states store ~2.4x bf16's losslessly (two low mantissa bytes a value hardly compress): planned
    as bf16, a float32 run's units (and the disk check that sums them) came out 2.4x the asked size."""
    from dflash.extract.prepare import prepare

    _, ds, target, tmp_path = setup
    common = f"--target {target} --dataset {ds} --out {tmp_path / 'c'} --unit-size 16MiB".split()
    common += ["--token-budget", "128", "--max-len", "50"]  # ~30 batches of ~4.6 MB (bf16)
    config = config_from_args(common)
    bf16, fp32 = (prepare(config, dtype) for dtype in ("bfloat16", "float32"))
    assert len(bf16.batches) == len(fp32.batches)  # the same batches, grouped into other units
    bf16_bytes, fp32_bytes = (sum(u.est_bytes for u in run.units) for run in (bf16, fp32))
    assert 2.2 < fp32_bytes / bf16_bytes < 2.6
    assert 2.0 < len(fp32.units) / len(bf16.units) < 2.8
    assert max(u.est_bytes for u in fp32.units) < 2 * (16 << 20)  # each within a batch of the asked size
    auto_on_cpu = config_from_args([*common, "--dtype", "auto", "--device", "cpu"])
    assert prepare(auto_on_cpu).units == fp32.units  # planned in what the run will compute in: float32
