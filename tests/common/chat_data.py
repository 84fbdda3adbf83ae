"""Chat-data fixtures for the tokenizer tests: conversations in every input form, and tokenizer dirs.

Tokenizers come from `dflash.tools.tiny.build_tiny_tokenizer` (offline, ~0.1 s): one with the
ChatML template's `{% generation %}` markers, one with the same ChatML minus the markers (the
char-offset fallback), and variants whose template raises or rewrites content.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

# ChatML without generation markers: `dflash-tokenize` must fall back to character offsets.
CHATML_NO_MARKERS = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Raises for conversations that start with an assistant turn (like real templates' role checks).
CHATML_RAISES = (
    "{%- if messages[0]['role'] == 'assistant' %}{{- raise_exception('conversation must not start with the assistant') }}{%- endif %}"
    + CHATML_NO_MARKERS
)
# Rewrites assistant content (upper-cases it): the char-offset fallback cannot find it.
CHATML_REWRITES = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' + message['content'] | upper + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
)

# Well-formed conversations (OpenAI style). Assistant contents are distinct so their spans are unambiguous,
# except REPEATED, whose assistant repeats the user's text (the span must be the assistant's own copy).
GOOD: list[list[dict[str, str]]] = [
    [
        {"role": "user", "content": "Count from 3 to 9."},
        {"role": "assistant", "content": "Sure! Counting from 3 to 9: 3 4 5 6 7 8 9. Done."},
    ],
    [
        {"role": "system", "content": "You are a tiny helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Japan?"},
        {"role": "assistant", "content": "The capital of Japan is Tokyo. Is there anything else?"},
    ],
    [
        {"role": "user", "content": "Say hello world 2 times."},
        {"role": "assistant", "content": "hello world, hello world."},
    ],
]
REPEATED = [
    {"role": "user", "content": "echo: blue fish"},
    {"role": "assistant", "content": "blue fish"},
]

# One malformed conversation per skip reason (the value of the messages field).
MALFORMED: dict[str, Any] = {
    "not_a_list": "just a string",
    "empty": [],
    "bad_message": [{"role": "user", "content": "hi"}, "not a dict"],
    "unknown_role": [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "ok"}],
    "non_string_content": [{"role": "user", "content": 7}, {"role": "assistant", "content": "ok"}],
    "no_assistant_turn": [{"role": "user", "content": "anyone there?"}],
}


def to_sharegpt(conv: list[dict[str, str]]) -> list[dict[str, str]]:
    """The same conversation in ShareGPT form (from/value, human/gpt)."""
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    return [{"from": names[m["role"]], "value": m["content"]} for m in conv]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    """Rows are dicts (dumped as JSON) or raw strings (written as they are: for broken lines)."""
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def write_parquet(path: Path, key: str, conversations: list[list[dict[str, str]]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({key: conversations, "id": list(range(len(conversations)))}), path)
    return path


def write_save_to_disk(path: Path, key: str, conversations: list[list[dict[str, str]]]) -> Path:
    import datasets

    datasets.Dataset.from_dict({key: conversations, "id": list(range(len(conversations)))}).save_to_disk(
        str(path)
    )
    return path


def make_tokenizers(root: Path) -> dict[str, Path]:
    """Tokenizer dirs: "markers" (ChatML with generation markers), "offsets", "raises", "rewrites"."""
    from dflash.tools.tiny import build_tiny_tokenizer

    dirs = {"markers": root / "tok_markers"}
    build_tiny_tokenizer(dirs["markers"], vocab_size=320)
    for name, template in (
        ("offsets", CHATML_NO_MARKERS),
        ("raises", CHATML_RAISES),
        ("rewrites", CHATML_REWRITES),
    ):
        dirs[name] = root / f"tok_{name}"
        shutil.copytree(dirs["markers"], dirs[name])
        _set_template(dirs[name], template)
    return dirs


def _set_template(tok_dir: Path, template: str) -> None:
    from transformers import AutoTokenizer

    for stale in ("chat_template.jinja", "chat_template.json"):
        (tok_dir / stale).unlink(missing_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(tok_dir))
