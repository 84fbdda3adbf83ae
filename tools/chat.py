"""Chat conversations: normalization, validation and assistant-span -> loss-mask logic.

Pure (numpy only, no tokenizer, no I/O) so every rule is testable on its own. `dflash-tokenize`
calls these per row; a malformed conversation raises `Malformed(reason)` and is counted, never fatal.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np
from dflash.shards.errors import ShardError
from dflash.shards.safe_io import load_json

Message = dict[str, str]

FORMATS = ("messages", "conversations")  # OpenAI-style / ShareGPT-style column names
ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
}
# The key pairs a message may use: OpenAI (role, content), ShareGPT (from, value).
_MESSAGE_KEYS = (("role", "content"), ("from", "value"))

# Why a row was skipped; the summary counts rows per reason.
SKIP_REASONS = (
    "invalid_json",  # a JSONL line that is not a JSON object
    "missing_field",  # the row has no messages/conversations value
    "not_a_list",  # the value is not a list of messages
    "empty",  # no messages, or every message's content is blank
    "bad_message",  # a message is not an object with a role and a content
    "unknown_role",  # a role outside system/user/assistant (human/gpt)
    "non_string_content",  # content is not a string (nor a list of text parts)
    "no_assistant_turn",  # nothing to supervise
    "template_error",  # the chat template raised on this conversation
    "content_not_found",  # char-offset fallback: the template changed an assistant content
    "no_supervised_tokens",  # the template marked no assistant token
    "no_supervised_after_truncation",  # --max-len cut off every supervised token
)

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class Malformed(Exception):
    """A conversation `dflash-tokenize` skips; `reason` is one of `SKIP_REASONS`."""

    def __init__(self, reason: str, detail: str = ""):
        assert reason in SKIP_REASONS, reason
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


def has_generation_markers(chat_template: str | None) -> bool:
    """True when the template marks assistant output with `{% generation %}` blocks."""
    return bool(chat_template) and _GENERATION_TAG.search(chat_template) is not None


def parse_json_row(line: str | bytes, key: str) -> Any:
    """The `key` value of one JSONL line; raises `Malformed` for bad JSON or a missing key."""
    try:
        row = load_json(line, "line")  # depth-limited: a nested bomb is a malformed row, not a RecursionError
    except (ShardError, TypeError) as exc:
        raise Malformed("invalid_json", str(exc)) from None
    if not isinstance(row, dict):
        raise Malformed("invalid_json", f"a line holds a {type(row).__name__}, not an object")
    if key not in row or row[key] is None:
        raise Malformed("missing_field", f"no {key!r} in {sorted(row)[:8]}")
    return row[key]


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    # OpenAI content parts: a list of {"type": "text", "text": ...}; anything else (images, None) is not text.
    if isinstance(content, list) and content:
        parts = []
        for part in content:
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise Malformed("non_string_content", "content list holds a non-text part")
            parts.append(part["text"])
        return "".join(parts)
    raise Malformed("non_string_content", f"content is {type(content).__name__}")


def normalize_conversation(value: Any) -> list[Message]:
    """Validate one conversation and return it as `[{"role", "content"}]` with canonical roles.

    Accepts OpenAI (`role`/`content`) and ShareGPT (`from`/`value`, human/gpt) messages, also as a
    JSON string; drops other keys. Raises `Malformed` naming the first problem found.
    """
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:  # some datasets store the conversation as a JSON string
            value = load_json(value, "conversation")
        except ShardError:
            raise Malformed("not_a_list", "a string that is not a JSON list") from None
    if not isinstance(value, (list, tuple)):
        raise Malformed("not_a_list", f"got {type(value).__name__}")
    if not value:
        raise Malformed("empty", "no messages")
    messages: list[Message] = []
    for i, raw in enumerate(value):
        if not isinstance(raw, dict):
            raise Malformed("bad_message", f"message {i} is {type(raw).__name__}")
        keys = next(((r, c) for r, c in _MESSAGE_KEYS if raw.get(r) is not None), None)
        if keys is None:
            raise Malformed("bad_message", f"message {i} has no role/from")
        role_key, content_key = keys
        role = raw[role_key]
        canonical = ROLE_ALIASES.get(role.strip().lower()) if isinstance(role, str) else None
        if canonical is None:
            raise Malformed("unknown_role", f"message {i} role {role!r}")
        if content_key not in raw:
            raise Malformed("bad_message", f"message {i} has no {content_key!r}")
        messages.append({"role": canonical, "content": _content_text(raw[content_key])})
    if all(not m["content"].strip() for m in messages):
        raise Malformed("empty", "every message is blank")
    if not any(m["role"] == "assistant" for m in messages):
        raise Malformed("no_assistant_turn")
    return messages


def cut_conversation(messages: list[Message], max_chars: int) -> tuple[list[Message], bool]:
    """The messages whose contents fit in `max_chars` characters in total, the one reaching the limit cut
    there, the rest dropped; and whether anything was cut. Tokenizing a conversation costs memory in
    proportion to its length, and `--max-len` keeps only its first tokens anyway (see `chat_tokenize`)."""
    kept: list[Message] = []
    left = max_chars
    for message in messages:
        if len(message["content"]) > left:
            if left > 0:
                kept.append({"role": message["role"], "content": message["content"][:left]})
            return kept, True
        kept.append(message)
        left -= len(message["content"])
    return kept, False


def assistant_char_spans(text: str, messages: Sequence[Message]) -> list[tuple[int, int]]:
    """[start, end) of each assistant content in the rendered `text`, one per assistant turn, in order.

    Messages are located left to right, so a content that repeats an earlier one is found at its own
    turn. A template that rewrites a content (e.g. drops reasoning) makes it unfindable: `Malformed`.
    """
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        content = message["content"]
        if not content.strip():
            if message["role"] == "assistant":
                spans.append((cursor, cursor))
            continue
        start = -1
        for candidate in _renderings(content):
            start = text.find(candidate, cursor)
            if start >= 0:
                content = candidate
                break
        if start < 0:
            if message["role"] != "assistant":
                continue  # a rewritten system/user message does not move assistant spans
            raise Malformed("content_not_found", f"assistant message {i} is not in the rendered template")
        if message["role"] == "assistant":
            spans.append((start, start + len(content)))
        cursor = start + len(content)
    return spans


def _renderings(content: str) -> list[str]:
    """How templates commonly render a content: as is, stripped, or (Qwen3 history) without its reasoning."""
    out = [content, content.strip()]
    if "</think>" in content:
        out.append(content.rsplit("</think>", 1)[1].strip())
    return [c for c in out if c]


def spans_to_mask(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """uint8 mask: 1 for each token whose [start, end) char offsets overlap an assistant span.

    `offsets` is [T, 2] from a fast tokenizer; zero-width tokens are never supervised. Spans must be
    sorted and disjoint (as `assistant_char_spans` returns them).
    """
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    spans = [(s, e) for s, e in spans if e > s]
    if not spans or not len(offsets):
        return np.zeros(len(offsets), dtype=np.uint8)
    span_start = np.array([s for s, _ in spans], dtype=np.int64)
    span_end = np.array([e for _, e in spans], dtype=np.int64)
    tok_start, tok_end = offsets[:, 0], offsets[:, 1]
    # The first span ending after the token starts is the only one it can overlap.
    idx = np.searchsorted(span_end, tok_start, side="right")
    inside = idx < len(spans)
    overlap = np.zeros(len(offsets), dtype=bool)
    overlap[inside] = tok_end[inside] > span_start[idx[inside]]
    return (overlap & (tok_end > tok_start)).astype(np.uint8)


def keep_last_run(mask: np.ndarray) -> np.ndarray:
    """Zero every run of ones except the last: the last assistant turn of a generation-marker mask."""
    mask = np.asarray(mask, dtype=np.uint8)
    ones = np.flatnonzero(mask)
    if not len(ones):
        return mask.copy()
    end = ones[-1]
    zeros_before = np.flatnonzero(mask[:end] == 0)
    start = zeros_before[-1] + 1 if len(zeros_before) else 0
    out = np.zeros_like(mask)
    out[start : end + 1] = 1
    return out
