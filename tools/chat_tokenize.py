"""The per-batch work of `dflash-tokenize`: conversations -> input_ids + assistant loss_mask.

`ConversationEncoder` is the function `datasets.map(batched=True, num_proc=N)` runs: picklable (it
carries the tokenizer's directory and loads it once per worker process), and it never raises for a
bad row: each output row carries `skip_reason` ("" when kept) so the caller can count and drop.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .chat import (
    Malformed,
    assistant_char_spans,
    cut_conversation,
    keep_last_run,
    normalize_conversation,
    parse_json_row,
    spans_to_mask,
)

# Characters of content kept per --max-len token before tokenizing: tokens average ~4 characters in English
# (fewer in code and CJK), so a conversation cut here still fills --max-len tokens, while one message of
# millions of words costs no more memory than its first 8 x max_len characters.
CHARS_PER_TOKEN_BOUND = 8


class ConversationEncoder:
    """Encode a batch of raw conversations. See `dflash.tools.tokenize` for the output columns."""

    def __init__(
        self,
        *,
        tokenizer_dir: str,
        key: str,
        raw_lines: bool,
        use_markers: bool,
        last_turn_only: bool,
        max_len: int | None,
    ):
        self.tokenizer_dir = tokenizer_dir
        self.key = key
        self.raw_lines = raw_lines
        self.use_markers = use_markers
        self.last_turn_only = last_turn_only
        self.max_len = max_len
        self._tokenizer = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_tokenizer"] = None  # each worker loads its own copy
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        return self._tokenizer

    # ---- per row

    def _normalize(self, value: Any) -> list[dict[str, str]]:
        if self.raw_lines:
            value = parse_json_row(value, self.key)
        return normalize_conversation(value)

    def _render(self, conversations: list[list[dict[str, str]]], **kwargs):
        """`apply_chat_template` on the batch; on failure, row by row so one bad row only skips itself."""
        try:
            return list(_as_rows(self.tokenizer.apply_chat_template(conversations, **kwargs))), [None] * len(
                conversations
            )
        except Exception:  # the template's own raise_exception, or jinja errors: isolate the culprit
            results, errors = [], []
            for conv in conversations:
                try:
                    results.append(next(iter(_as_rows(self.tokenizer.apply_chat_template([conv], **kwargs)))))
                    errors.append(None)
                except Exception as exc:
                    results.append(None)
                    errors.append(Malformed("template_error", f"{type(exc).__name__}: {exc}"))
            return results, errors

    def _encode_with_markers(self, conversations):
        rendered, errors = self._render(
            conversations, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        out = []
        for item, error in zip(rendered, errors, strict=True):
            if error is not None:
                out.append(error)
                continue
            ids, mask = item
            mask = np.asarray(mask, dtype=np.uint8)
            out.append(
                (np.asarray(ids, dtype=np.int32), keep_last_run(mask) if self.last_turn_only else mask)
            )
        return out

    def _encode_with_offsets(self, conversations):
        texts, errors = self._render(conversations, tokenize=False)
        out: list[Any] = list(errors)
        todo = []
        for i, (conv, text, error) in enumerate(zip(conversations, texts, errors, strict=True)):
            if error is not None:
                continue
            try:
                spans = assistant_char_spans(text, conv)
            except Malformed as exc:
                out[i] = exc
                continue
            todo.append((i, text, spans[-1:] if self.last_turn_only else spans))
        if todo:
            enc = self.tokenizer(
                [text for _, text, _ in todo], add_special_tokens=False, return_offsets_mapping=True
            )
            for (i, _text, spans), ids, offsets in zip(
                todo, enc["input_ids"], enc["offset_mapping"], strict=True
            ):
                out[i] = (np.asarray(ids, dtype=np.int32), spans_to_mask(np.asarray(offsets), spans))
        return out

    def _cut(self, conv: list[dict[str, str]]) -> tuple[list[dict[str, str]] | Malformed, bool]:
        """`conv` cut to what --max-len can keep (`CHARS_PER_TOKEN_BOUND`), before anything is tokenized."""
        assert self.max_len is not None
        kept, cut = cut_conversation(conv, self.max_len * CHARS_PER_TOKEN_BOUND)
        if not cut:
            return conv, False
        last_assistant = max(i for i, m in enumerate(conv) if m["role"] == "assistant")
        if len(kept) <= last_assistant and (
            self.last_turn_only or not any(m["role"] == "assistant" for m in kept)
        ):
            return Malformed("no_supervised_after_truncation", "the supervised turn is past --max-len"), True
        return kept, True

    def __call__(self, values: list[Any]) -> dict[str, list]:
        normalized: list[Any] = []
        for value in values:
            try:
                normalized.append(self._normalize(value))
            except Malformed as exc:
                normalized.append(exc)
        cut = [False] * len(normalized)
        if self.max_len is not None:
            for i, conv in enumerate(normalized):
                if not isinstance(conv, Malformed):
                    normalized[i], cut[i] = self._cut(conv)
        good = [i for i, n in enumerate(normalized) if not isinstance(n, Malformed)]
        convs = [normalized[i] for i in good]
        if convs:
            encoded = (
                self._encode_with_markers(convs) if self.use_markers else self._encode_with_offsets(convs)
            )
            for i, result in zip(good, encoded, strict=True):
                normalized[i] = result
        cols: dict[str, list] = {
            k: [] for k in ("input_ids", "loss_mask", "seq_len", "supervised", "truncated", "skip_reason")
        }
        for result, was_cut in zip(normalized, cut, strict=True):
            reason, truncated = "", was_cut
            if isinstance(result, Malformed):
                reason, ids, mask = result.reason, np.zeros(0, np.int32), np.zeros(0, np.uint8)
            else:
                ids, mask = result
                if self.max_len is not None and len(ids) > self.max_len:
                    ids, mask, truncated = ids[: self.max_len], mask[: self.max_len], True
                supervised = int(mask.sum())
                if supervised == 0:
                    reason = "no_supervised_after_truncation" if truncated else "no_supervised_tokens"
            if reason:
                ids, mask = np.zeros(0, np.int32), np.zeros(0, np.uint8)
            cols["input_ids"].append(ids)
            cols["loss_mask"].append(mask)
            cols["seq_len"].append(len(ids))
            cols["supervised"].append(int(mask.sum()))
            cols["truncated"].append(truncated and not reason)
            cols["skip_reason"].append(reason)
        return cols


def _as_rows(result):
    """Rows of an `apply_chat_template` batch result: strings, or (input_ids, assistant_masks) pairs."""
    if isinstance(result, list):
        return result
    return zip(result["input_ids"], result["assistant_masks"], strict=True)
