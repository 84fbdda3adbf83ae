"""The prose target's corpus: natural language found on the machine, as chat rows.

Two sources, neither downloaded: the docstrings of the `.py` files the code target reads (`ast`, one row per
module, class or function: "Explain {qualified name}." answered by its docstring), and the reST, Markdown and
plain-text documents shipped with the standard library and installed packages (indented blocks left out) (one row per section: "Explain
{title}." or "Continue this text:" + its first line, answered by the rest). Licence files and text that is not
mostly words (tables, requirement lists, code blocks, doctests) are left out. Each row is a ChatML exchange; a
source is held out by the hash of its name as the code corpus' files are (a `.py` file's docstrings go with its
code), and a row whose answer already appeared earlier in the seeded order is dropped, so no held-out answer is
also a training one.
"""

from __future__ import annotations

import ast
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bench.quality_data import corpus_stats, is_heldout, package_roots, source_files

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHAT_TOKENS = (IM_START, IM_END)
ASSISTANT = f"{IM_START}assistant\n"
DOC_SUFFIXES = (".rst", ".md", ".txt")
SECTION_CHARS = 2000  # a document's paragraphs are grouped into rows of about this many characters
MIN_ANSWER_CHARS = 160
# Lines that are Python, not prose: doctests, definitions, imports, decorators.
_CODE_LINE = re.compile(r"^\s*(>>>|\.\.\. |def \w+\(|class \w+[(:]|import \w|from [\w.]+ import |@\w)", re.M)
_FENCE = re.compile(r"^\s*```.*?^\s*```[^\n]*$", re.M | re.S)
_NOT_PROSE_NAMES = ("LICENSE", "LICENCE", "COPYING", "NOTICE", "AUTHORS", "RECORD", "ENTRY_POINTS",
                    "TOP_LEVEL", "REQUIRES", "REQUIREMENTS", "SOURCES", "DEPENDENCY_LINKS")  # fmt: skip


def chat_row(user: str, answer: str) -> str:
    """One ChatML exchange: the user's turn, then the assistant's answer (what the target learns to write)."""
    return f"{IM_START}user\n{user}{IM_END}\n{ASSISTANT}{answer}{IM_END}\n"


def is_prose(text: str, min_chars: int = MIN_ANSWER_CHARS) -> bool:
    """Mostly words: letters and spaces make >= 80% of it, and no line of it is Python."""
    if len(text) < min_chars or _CODE_LINE.search(text):
        return False
    return sum(c.isalpha() or c == " " for c in text) >= 0.8 * len(text)


def docstring_rows(source: str, module: str) -> Iterator[str]:
    """A chat row per module, class and function docstring of `source` that is prose."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return

    def walk(node: ast.AST, name: str) -> Iterator[str]:
        doc = ast.get_docstring(node)  # type: ignore[arg-type]
        if doc and is_prose(doc):
            yield chat_row(f"Explain {name}.", doc)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from walk(child, f"{name}.{child.name}")

    yield from walk(tree, module)


def _title(lines: list[str]) -> tuple[str | None, list[str]]:
    """(a section's title, the lines after it) for a Markdown `#` heading or a reST underlined one."""
    first = lines[0].strip()
    if first.startswith("#"):
        return first.lstrip("#").strip() or None, lines[1:]
    if len(lines) > 1 and len(set(lines[1].strip())) == 1 and lines[1].strip()[0] in "=-~^*+#":
        return first, lines[2:]
    return None, lines


def document_rows(text: str) -> Iterator[str]:
    """A chat row per section of a text document: its paragraphs grouped up to ~SECTION_CHARS each."""
    paragraphs = [p.strip("\n") for p in re.split(r"\n\s*\n", _FENCE.sub("", text)) if p.strip()]
    # Indented blocks are literal (reST `::`, Markdown code, JSON output): not prose.
    paragraphs = [
        p for p in paragraphs if not all(line[:1].isspace() for line in p.splitlines() if line.strip())
    ]
    section: list[str] = []
    for i, paragraph in enumerate(paragraphs):
        section.append(paragraph)
        if i + 1 < len(paragraphs) and sum(map(len, section)) < SECTION_CHARS:
            continue
        lines = "\n\n".join(section).splitlines()
        section = []
        title, rest = _title(lines)
        if title is None:
            title, rest = None, lines[1:]
            user = f"Continue this text:\n{lines[0].strip()}"
        else:
            user = f"Explain {title}."
        answer = "\n".join(rest).strip()
        if is_prose(answer) and len(user) < 200:
            yield chat_row(user, answer)


def doc_files() -> list[tuple[str, Path]]:
    """(stable name, path) of the text documents of the stdlib and of every site-packages folder."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sites = {Path(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
    sites |= {root.parent for _, root in package_roots()}
    roots = [("stdlib", stdlib)] + [(f"site{i}", s) for i, s in enumerate(sorted(sites)) if s.is_dir()]
    files = {}
    for label, root in roots:
        for path in root.rglob("*"):
            if path.suffix not in DOC_SUFFIXES or not path.is_file():
                continue
            rel = path.relative_to(root).as_posix()
            if label == "stdlib" and rel.split("/")[0] in ("site-packages", "dist-packages"):
                continue
            upper = rel.upper()
            if any(word in upper for word in _NOT_PROSE_NAMES):
                continue
            # Named by the path inside its folder, so machines with other install prefixes agree.
            files[f"{'stdlib' if label == 'stdlib' else 'site-packages'}/{rel}"] = path
    return sorted(files.items())


def prose_sources() -> list[tuple[str, Path]]:
    """Every source of prose rows, sorted by name: `.py` files (their docstrings) and text documents."""
    return sorted(source_files() + doc_files())


def source_rows(name: str, path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    if path.suffix == ".py":
        module = name.removeprefix("stdlib/").removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        return list(docstring_rows(text, module))
    return list(document_rows(text))


def read_prose_corpus(max_bytes: int, seed: int) -> tuple[list[str], list[str], dict[str, Any]]:
    """(train rows, held-out rows, stats): every source's rows in a seeded order until `max_bytes` are read."""
    sources = prose_sources()
    order = np.random.default_rng(seed).permutation(len(sources))
    train, held, seen, used, files, held_files = [], [], set(), 0, 0, 0
    for i in order:
        name, path = sources[i]
        rows = [r for r in source_rows(name, path) if r not in seen]
        if not rows:
            continue
        seen.update(rows)
        heldout = is_heldout(name)
        (held if heldout else train).extend(rows)
        files, held_files = files + 1, held_files + heldout
        used += sum(map(len, rows))
        if used >= max_bytes:
            break
    return train, held, corpus_stats(train, held, used, files, held_files)


def answer_starts(ids: np.ndarray, header: np.ndarray) -> np.ndarray:
    """Token offsets just past each assistant header (`ASSISTANT`'s tokens) in a tokenized row."""
    if len(ids) < len(header):
        return np.zeros(0, dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(ids, len(header))
    return np.flatnonzero((windows == header).all(axis=1)) + len(header)


def cut_chat_prompts(
    rows: list[np.ndarray], n: int, spec: Any, header: np.ndarray, rng: np.random.Generator
) -> list[np.ndarray]:
    """`n` prompts: a row's user turn and the beginning of its answer, cut at a random point (the prompt is
    `prompt_min`..`prompt_max` tokens where the user turn allows), from rows picked in proportion to length."""
    cuts = []  # (row, earliest cut, latest cut)
    for r, ids in enumerate(rows):
        starts = answer_starts(ids, header)
        if len(starts):
            a = int(starts[0])
            low, high = max(a + 1, spec.prompt_min), min(spec.prompt_max, len(ids) - 1)
            if low <= high:
                cuts.append((r, low, high))
    if not cuts:
        raise ValueError("no chat row has an answer within prompt_max tokens of its start")
    weights = np.array([len(rows[r]) for r, _, _ in cuts], dtype=np.float64)
    picks = rng.choice(len(cuts), size=n, p=weights / weights.sum())
    return [rows[cuts[i][0]][: int(rng.integers(cuts[i][1], cuts[i][2] + 1))] for i in picks]
