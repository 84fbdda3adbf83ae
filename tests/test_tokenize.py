"""`dflash-tokenize`: input forms, loss masks, skips, truncation, output format, the CLI (its pure chat logic:
`test_chat.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from common.chat_data import (
    GOOD,
    MALFORMED,
    REPEATED,
    make_tokenizers,
    to_sharegpt,
    write_jsonl,
    write_parquet,
    write_save_to_disk,
)
from dflash.tools.tokenize import SUMMARY_NAME, TokenizeConfig, main, tokenize_chats


@pytest.fixture(scope="module")
def toks(tmp_path_factory) -> dict[str, Path]:
    return make_tokenizers(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tokenizer(toks):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(toks["markers"]))


def run(tmp_path: Path, data: Path, tok: Path, name: str = "out", **kw) -> tuple[dict, list[dict]]:
    out = tmp_path / name
    summary = tokenize_chats(TokenizeConfig(data=str(data), tokenizer=str(tok), out=str(out), **kw))
    import datasets

    rows = datasets.load_from_disk(str(out)).to_list()
    return summary, rows


def supervised_text(tokenizer, row: dict) -> str:
    ids = np.asarray(row["input_ids"])
    mask = np.asarray(row["loss_mask"], dtype=bool)
    return tokenizer.decode(ids[mask].tolist())


def assistant_text(conv, last_only=False, suffix=""):
    turns = [m["content"] + suffix for m in conv if m["role"] == "assistant"]
    return "".join(turns[-1:] if last_only else turns)


def test_empty_assistant_content_under_offsets_is_no_supervised_tokens(tmp_path, toks):
    empty_answer = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]
    data = write_jsonl(tmp_path / "m.jsonl", [{"messages": empty_answer}, {"messages": GOOD[0]}])
    summary, _ = run(tmp_path, data, toks["offsets"])
    assert summary["skipped"] == {"no_supervised_tokens": 1} and summary["rows_out"] == 1
    # With generation markers the template still marks <|im_end|>: the row is kept.
    summary, rows = run(tmp_path, data, toks["markers"], name="markers")
    assert summary["rows_out"] == 2 and sum(rows[0]["loss_mask"]) == 1


def test_config_rejects_bad_settings(tmp_path):
    base = {"data": "d.jsonl", "tokenizer": "t", "out": str(tmp_path / "o")}
    for bad, match in (
        ({"format": "alpaca"}, "--format"),
        ({"max_len": 1}, "--max-len"),
        ({"num_proc": 0}, "--num-proc"),
    ):
        with pytest.raises(ValueError, match=match):
            TokenizeConfig(**base, **bad)
    with pytest.raises(ValueError, match="inside"):
        TokenizeConfig(data=str(tmp_path), tokenizer="t", out=str(tmp_path / "o"))


# ---- input forms and masks


def test_each_input_form_gives_the_same_tokens(tmp_path, toks):
    convs = [*GOOD, REPEATED]
    forms = {
        "jsonl_messages": write_jsonl(
            tmp_path / "m.jsonl", [{"messages": c, "id": i} for i, c in enumerate(convs)]
        ),
        "jsonl_conversations": write_jsonl(
            tmp_path / "c.jsonl", [{"conversations": to_sharegpt(c)} for c in convs]
        ),
        "parquet": write_parquet(tmp_path / "m.parquet", "messages", convs),
        "save_to_disk": write_save_to_disk(
            tmp_path / "sharegpt_ds", "conversations", [to_sharegpt(c) for c in convs]
        ),
    }
    results = {}
    for name, path in forms.items():
        summary, rows = run(tmp_path, path, toks["markers"], name=f"out_{name}")
        assert summary["rows_in"] == summary["rows_out"] == len(convs), name
        assert summary["format"] == (
            "conversations" if "conversations" in name or "disk" in name else "messages"
        )
        results[name] = rows
    reference = results.pop("jsonl_messages")
    for name, rows in results.items():
        assert rows == reference, name


@pytest.mark.parametrize("last_turn_only", [False, True])
def test_generation_markers_supervise_what_the_template_marks(tmp_path, toks, tokenizer, last_turn_only):
    convs = [*GOOD, REPEATED]
    data = write_jsonl(tmp_path / "m.jsonl", [{"messages": c} for c in convs])
    summary, rows = run(tmp_path, data, toks["markers"], last_turn_only=last_turn_only)
    assert summary["mask_source"] == "generation_markers"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    for conv, row in zip(convs, rows, strict=True):
        # The tiny template puts content + <|im_end|> inside {% generation %}: exactly that is supervised.
        assert supervised_text(tokenizer, row) == assistant_text(conv, last_turn_only, suffix="<|im_end|>")
        ids, mask = np.asarray(row["input_ids"]), np.asarray(row["loss_mask"])
        assert not mask[ids == im_start].any()
        assert mask[ids == im_end].sum() == (
            1 if last_turn_only else sum(m["role"] == "assistant" for m in conv)
        )
        assert row["seq_len"] == len(ids) == len(mask)
        expected_ids = tokenizer.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]
        assert row["input_ids"] == list(expected_ids)
    assert summary["supervised_tokens"] == sum(sum(r["loss_mask"]) for r in rows)
    assert summary["tokens"] == sum(r["seq_len"] for r in rows)


@pytest.mark.parametrize("last_turn_only", [False, True])
def test_char_offsets_fallback_supervises_assistant_content_only(tmp_path, toks, tokenizer, last_turn_only):
    convs = [*GOOD, REPEATED]
    data = write_jsonl(tmp_path / "m.jsonl", [{"messages": c} for c in convs])
    summary, rows = run(tmp_path, data, toks["offsets"], last_turn_only=last_turn_only)
    assert summary["mask_source"] == "char_offsets"
    for conv, row in zip(convs, rows, strict=True):
        # Template tokens (role headers, <|im_end|>, newlines) are never supervised without markers.
        assert supervised_text(tokenizer, row) == assistant_text(conv, last_turn_only)
        ids, mask = np.asarray(row["input_ids"]), np.asarray(row["loss_mask"])
        assert not mask[ids == tokenizer.convert_tokens_to_ids("<|im_end|>")].any()


def test_malformed_rows_are_counted_by_reason_and_never_fatal(tmp_path, toks):
    rows = [{"messages": GOOD[0]}]
    rows += [{"messages": value} for value in MALFORMED.values()]
    rows += ["{broken json", '["a list"]', {"text": "no messages here"}, {"messages": GOOD[1]}]
    rows += [{"messages": [{"role": "assistant", "content": "I start."}, {"role": "user", "content": "hm"}]}]
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    summary, out = run(tmp_path, data, toks["raises"])
    expected = {reason: 1 for reason in MALFORMED}
    expected.update(invalid_json=2, missing_field=1, template_error=1)
    assert summary["skipped"] == expected
    assert summary["rows_in"] == len(rows) and summary["rows_out"] == 2 == len(out)
    assert summary["rows_skipped"] == sum(expected.values())
    # Rewritten content under the offsets fallback is a counted skip too.
    summary, _ = run(
        tmp_path,
        write_jsonl(tmp_path / "g.jsonl", [{"messages": c} for c in GOOD]),
        toks["rewrites"],
        name="o2",
    )
    assert summary["skipped"] == {"content_not_found": len(GOOD)} and summary["rows_out"] == 0


def test_max_len_truncates_and_drops_rows_left_without_supervision(tmp_path, toks, tokenizer):
    long_prompt = [{"role": "user", "content": "word " * 60}, {"role": "assistant", "content": "ok"}]
    data = write_jsonl(tmp_path / "m.jsonl", [{"messages": c} for c in [*GOOD, long_prompt]])
    _, full_rows = run(tmp_path, data, toks["markers"], name="full")
    first_supervised = [r["loss_mask"].index(1) for r in full_rows]
    max_len = first_supervised[0] + 3  # keeps part of the first answer, cuts the long prompt's away
    assert first_supervised[-1] >= max_len and full_rows[0]["seq_len"] > max_len
    summary, rows = run(tmp_path, data, toks["markers"], name="cut", max_len=max_len)
    dropped = sum(f >= max_len for f in first_supervised)
    assert summary["skipped"] == {"no_supervised_after_truncation": dropped}
    kept_full = [r for r, f in zip(full_rows, first_supervised, strict=True) if f < max_len]
    assert summary["truncated_rows"] == sum(r["seq_len"] > max_len for r in kept_full) >= 1
    assert summary["max_seq_len"] == max_len
    for before, after in zip(kept_full, rows, strict=True):
        assert after["input_ids"] == before["input_ids"][:max_len]
        assert after["loss_mask"] == before["loss_mask"][:max_len]
        assert after["seq_len"] == min(before["seq_len"], max_len)
    argv = [
        "--data",
        str(data),
        "--tokenizer",
        str(toks["markers"]),
        "--out",
        str(tmp_path / "c"),
        "--max-len",
        str(max_len),
    ]
    assert f"--max-len {max_len}: {summary['truncated_rows']} conversations truncated" in _cli(argv)[1]


def test_output_format_for_extract(tmp_path, toks):
    data = write_jsonl(tmp_path / "m.jsonl", [{"messages": c} for c in GOOD])
    summary, rows = run(tmp_path, data, toks["markers"])
    out = tmp_path / "out"
    state = json.loads((out / "state.json").read_text())
    tables = []
    for entry in state["_data_files"]:
        with pa.ipc.open_stream(str(out / entry["filename"])) as reader:
            tables.append(reader.read_all())
    table = pa.concat_tables(tables)
    assert table.schema.field("input_ids").type.value_type == pa.int32()
    assert table.schema.field("loss_mask").type.value_type == pa.uint8()
    assert table.schema.field("seq_len").type == pa.int32()
    assert table.column_names == ["input_ids", "loss_mask", "seq_len"]
    assert table.column("seq_len").to_pylist() == [len(r["input_ids"]) for r in rows]
    assert json.loads((out / SUMMARY_NAME).read_text()) == summary
    try:
        from dflash.extract.dataset import open_dataset
    except ImportError:  # the extract phase is optional for this test
        return
    ds = open_dataset(out)
    assert ds.num_rows == len(rows)


def test_num_proc_matches_single_process(tmp_path, toks):
    convs = [*GOOD, REPEATED] * 5 + list(MALFORMED.values())
    data = write_jsonl(tmp_path / "m.jsonl", [{"messages": c} for c in convs])
    one, rows_one = run(tmp_path, data, toks["markers"], name="one", batch_size=3)
    two, rows_two = run(tmp_path, data, toks["markers"], name="two", batch_size=3, num_proc=2)
    assert rows_one == rows_two
    assert one["skipped"] == two["skipped"] and one["tokens"] == two["tokens"]


# ---- CLI


def _cli(argv: list[str]) -> tuple[int, str, str]:
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_cli_json_summary_and_refuses_to_clobber(tmp_path, toks):
    data = write_jsonl(tmp_path / "m.jsonl", [{"messages": c} for c in GOOD])
    argv = ["--data", str(data), "--tokenizer", str(toks["markers"]), "--out", str(tmp_path / "o"), "--json"]
    code, stdout, _ = _cli(argv)
    assert code == 0
    summary = json.loads(stdout)
    assert summary["rows_out"] == len(GOOD) and summary["skipped"] == {}
    code, _, err = _cli(argv)
    assert code == 2 and "not empty" in err and "--overwrite" in err
    assert _cli([*argv, "--overwrite"])[0] == 0


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "no such file"),
        ("suffix", "unknown file type"),
        ("no_column", "no 'messages' or 'conversations'"),
        ("wrong_format", "no 'conversations'"),
        ("parquet_no_column", "no 'messages' or 'conversations'"),
        ("no_template", "no chat template"),
        ("not_a_tokenizer", "cannot load a tokenizer"),
        ("json_array", "JSON array"),
    ],
)
def test_cli_bad_inputs_give_one_line_errors(tmp_path, toks, case, message):
    tok = toks["markers"]
    extra: list[str] = []
    data = write_jsonl(tmp_path / "m.jsonl", [{"messages": GOOD[0]}])
    if case == "missing":
        data = tmp_path / "absent.jsonl"
    elif case == "suffix":
        data = tmp_path / "chats.csv"
        data.write_text("a,b\n")
    elif case == "no_column":
        data = write_jsonl(tmp_path / "x.jsonl", [{"text": "hello"}])
    elif case == "wrong_format":
        extra = ["--format", "conversations"]
    elif case == "parquet_no_column":
        import pyarrow.parquet as pq

        data = tmp_path / "x.parquet"
        pq.write_table(pa.table({"text": ["a"]}), data)
    elif case == "no_template":
        import shutil

        tok = tmp_path / "tok"
        shutil.copytree(toks["markers"], tok)
        (tok / "chat_template.jinja").unlink()
    elif case == "not_a_tokenizer":
        tok = tmp_path / "empty_tok"
        tok.mkdir()
    elif case == "json_array":
        data = tmp_path / "x.json"
        data.write_text(json.dumps([{"messages": GOOD[0]}], indent=1))
    code, _, err = _cli(["--data", str(data), "--tokenizer", str(tok), "--out", str(tmp_path / "o"), *extra])
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("dflash-tokenize: error:") and message in err
    assert not (tmp_path / "o").exists()


def test_folder_gzip_and_bom_inputs(tmp_path, toks):
    import gzip

    folder = tmp_path / "parts"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", [{"messages": GOOD[0]}])
    with gzip.open(folder / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"messages": GOOD[1]}) + "\n")
    (folder / "c.jsonl").write_text("\ufeff" + json.dumps({"messages": GOOD[2]}) + "\r\n\n", encoding="utf-8")
    (folder / "notes.txt").write_text("ignored")
    summary, rows = run(tmp_path, folder, toks["markers"])
    assert summary["rows_out"] == 3 and summary["skipped"] == {}
    single, single_rows = run(tmp_path, folder / "c.jsonl", toks["markers"], name="single")
    assert single["rows_out"] == 1 and rows[2]["input_ids"] == single_rows[0]["input_ids"]


@pytest.mark.parametrize("existing", [False, True])
def test_a_failed_run_leaves_no_partial_output(tmp_path, toks, monkeypatch, existing):
    from dflash.tools import chat_tokenize

    data = write_jsonl(tmp_path / "m.jsonl", [{"messages": c} for c in GOOD * 4])
    out = tmp_path / "out"
    if existing:
        run(tmp_path, data, toks["markers"])
        before = sorted(p.name for p in out.iterdir())
    calls = {"n": 0}
    original = chat_tokenize.ConversationEncoder.__call__

    def crash_on_second_batch(self, values):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return original(self, values)

    monkeypatch.setattr(chat_tokenize.ConversationEncoder, "__call__", crash_on_second_batch)
    with pytest.raises(OSError, match="No space"):
        tokenize_chats(
            TokenizeConfig(
                data=str(data), tokenizer=str(toks["markers"]), out=str(out), batch_size=3, overwrite=True
            )
        )
    assert calls["n"] == 2
    # Nothing half-written: no scratch or staging dirs, and an old dataset (if any) is untouched.
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    if existing:
        assert sorted(p.name for p in out.iterdir()) == before
        import datasets

        assert len(datasets.load_from_disk(str(out))) == len(GOOD) * 4
    else:
        assert not out.exists()
