"""`dflash.tools.chat`, the pure chat logic under `dflash-tokenize`: conversations normalized, malformed rows
named, assistant spans found in the template's text and turned into loss masks."""

from __future__ import annotations

import json

import numpy as np
import pytest
from common.chat_data import (
    GOOD,
    MALFORMED,
    REPEATED,
    to_sharegpt,
)
from dflash.tools import chat
from hypothesis import given, settings
from hypothesis import strategies as st


@pytest.mark.parametrize("reason", sorted(MALFORMED))
def test_normalize_rejects_each_malformed_case(reason):
    with pytest.raises(chat.Malformed) as info:
        chat.normalize_conversation(MALFORMED[reason])
    assert info.value.reason == reason


def test_normalize_maps_sharegpt_and_text_parts():
    conv = GOOD[1]
    assert chat.normalize_conversation(to_sharegpt(conv)) == conv
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        conv[-1],
    ]
    assert chat.normalize_conversation(parts)[0]["content"] == "ab"
    with pytest.raises(chat.Malformed, match="non_string_content"):
        chat.normalize_conversation([{"role": "user", "content": [{"type": "image", "url": "x"}]}, conv[-1]])
    with pytest.raises(chat.Malformed, match="non_string_content"):
        chat.normalize_conversation([{"role": "user", "content": None}, conv[-1]])
    with pytest.raises(chat.Malformed, match="empty"):
        chat.normalize_conversation([{"role": "user", "content": " "}, {"role": "assistant", "content": ""}])


def test_normalize_accepts_a_json_string_conversation():
    assert chat.normalize_conversation(json.dumps(GOOD[0])) == GOOD[0]
    with pytest.raises(chat.Malformed, match="not_a_list"):
        chat.normalize_conversation("[not json")


def test_parse_json_row_reasons():
    assert chat.parse_json_row('{"messages": [1]}', "messages") == [1]
    for line, reason in (("nope", "invalid_json"), ("[1, 2]", "invalid_json"), ('{"x": 1}', "missing_field")):
        with pytest.raises(chat.Malformed) as info:
            chat.parse_json_row(line, "messages")
        assert info.value.reason == reason


def test_assistant_char_spans_follow_turn_order():
    text = "<u>echo: blue fish</u><a>blue fish</a>"
    spans = chat.assistant_char_spans(text, chat.normalize_conversation(REPEATED))
    assert spans == [(text.index("<a>") + 3, text.index("</a>"))]
    with pytest.raises(chat.Malformed, match="content_not_found"):
        chat.assistant_char_spans("<a>BLUE FISH</a>", [{"role": "assistant", "content": "blue fish"}])
    # Templates strip contents, and Qwen3's drops the reasoning of earlier assistant turns.
    reasoning = [
        {"role": "assistant", "content": "  <think>hm</think>\n\nfirst  "},
        {"role": "assistant", "content": "<think>ok</think>second"},
    ]
    text = "<a>first</a><a><think>ok</think>second</a>"
    first, second = chat.assistant_char_spans(text, reasoning)
    assert text[slice(*first)] == "first" and text[slice(*second)] == "<think>ok</think>second"


def test_generation_marker_detection():
    from dflash.tools.tiny import CHAT_TEMPLATE

    assert chat.has_generation_markers(CHAT_TEMPLATE)
    assert chat.has_generation_markers("{% generation %}x{% endgeneration %}")
    assert not chat.has_generation_markers("{{ message['content'] }} generation")
    assert not chat.has_generation_markers(None)


@st.composite
def offsets_and_spans(draw):
    lengths = draw(st.lists(st.integers(0, 4), min_size=0, max_size=30))
    ends = np.cumsum(lengths)
    offsets = np.stack([ends - np.array(lengths), ends], axis=1) if lengths else np.zeros((0, 2), int)
    cuts = sorted(draw(st.lists(st.integers(0, int(ends[-1]) if lengths else 0), max_size=6, unique=True)))
    spans = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2)]
    return offsets, spans


@settings(max_examples=200, deadline=None)
@given(offsets_and_spans())
def test_spans_to_mask_matches_brute_force(case):
    offsets, spans = case
    expected = [int(e > s and any(e > a and s < b for a, b in spans if b > a)) for s, e in offsets]
    assert chat.spans_to_mask(offsets, spans).tolist() == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1), max_size=40))
def test_keep_last_run_matches_brute_force(bits):
    out = chat.keep_last_run(np.array(bits, dtype=np.uint8)).tolist()
    expected = [0] * len(bits)
    i = len(bits) - 1
    while i >= 0 and bits[i] == 0:
        i -= 1
    while i >= 0 and bits[i] == 1:
        expected[i] = 1
        i -= 1
    assert out == expected
