"""The built-in chat corpus the tiny target learns from, and the prompts it answers.

Every task has a fixed answer template around a short computed part (a count, a letter walk, a
repetition, a looked-up fact), so the target's greedy answers are long runs of predictable tokens:
a drafter trained on them can guess several tokens ahead, which is what the demo must show.
Pure Python, deterministic for a seed, no I/O.
"""

from __future__ import annotations

import random
import string

Conversation = list[dict[str, str]]

_CAPITALS = (
    ("France", "Paris"),
    ("Spain", "Madrid"),
    ("Italy", "Rome"),
    ("Japan", "Tokyo"),
    ("Egypt", "Cairo"),
    ("Peru", "Lima"),
    ("Kenya", "Nairobi"),
    ("Norway", "Oslo"),
    ("Chile", "Santiago"),
    ("Greece", "Athens"),
    ("Canada", "Ottawa"),
    ("Poland", "Warsaw"),
)
_SOUNDS = (
    ("dog", "woof"),
    ("cat", "meow"),
    ("cow", "moo"),
    ("duck", "quack"),
    ("sheep", "baa"),
    ("owl", "hoot"),
    ("lion", "roar"),
    ("frog", "ribbit"),
)
_PHRASES = (
    "blue fish",
    "red hat",
    "good morning",
    "hello world",
    "green tree",
    "big cat",
    "small dog",
    "hot tea",
    "cold rain",
    "fast car",
)
_LETTERS = string.ascii_lowercase
_SYSTEM = "You are a tiny helpful assistant."


def _count_up(rng: random.Random) -> tuple[str, str]:
    start = rng.randint(0, 60)
    stop = start + rng.randint(5, 14)
    numbers = " ".join(str(i) for i in range(start, stop + 1))
    return f"Count from {start} to {stop}.", f"Sure! Counting from {start} to {stop}: {numbers}. Done."


def _count_down(rng: random.Random) -> tuple[str, str]:
    stop = rng.randint(0, 50)
    start = stop + rng.randint(5, 12)
    numbers = " ".join(str(i) for i in range(start, stop - 1, -1))
    return (
        f"Count down from {start} to {stop}.",
        f"Sure! Counting down from {start} to {stop}: {numbers}. Done.",
    )


def _letters(rng: random.Random) -> tuple[str, str]:
    first = rng.randint(0, 16)
    last = min(first + rng.randint(5, 12), len(_LETTERS) - 1)
    walk = " ".join(_LETTERS[first : last + 1])
    a, b = _LETTERS[first], _LETTERS[last]
    return f"List the letters from {a} to {b}.", f"Here are the letters from {a} to {b}: {walk}. Done."


def _repeat(rng: random.Random) -> tuple[str, str]:
    phrase = rng.choice(_PHRASES)
    times = rng.randint(2, 5)
    said = ", ".join([phrase] * times)
    return f"Say {phrase} {times} times.", f"Okay, I will say {phrase} {times} times: {said}. Done."


def _capital(rng: random.Random) -> tuple[str, str]:
    country, city = rng.choice(_CAPITALS)
    return (
        f"What is the capital of {country}?",
        f"The capital of {country} is {city}. Is there anything else?",
    )


def _sound(rng: random.Random) -> tuple[str, str]:
    animal, sound = rng.choice(_SOUNDS)
    return f"What does a {animal} say?", f"A {animal} says {sound}, {sound}, {sound}. Is there anything else?"


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    return f"What is {a} plus {b}?", f"Let me add them: {a} plus {b} is {a + b}. Is there anything else?"


_TASKS = (_count_up, _count_down, _letters, _repeat, _capital, _sound, _add)


def _one_turn(rng: random.Random) -> tuple[str, str]:
    return rng.choice(_TASKS)(rng)


def training_chats(num: int, seed: int) -> list[Conversation]:
    """`num` complete chats (user + assistant, a few with a system turn or a second exchange)."""
    rng = random.Random(seed)
    chats: list[Conversation] = []
    for _ in range(num):
        conv: Conversation = []
        if rng.random() < 0.15:
            conv.append({"role": "system", "content": _SYSTEM})
        for _turn in range(2 if rng.random() < 0.15 else 1):
            question, answer = _one_turn(rng)
            conv += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        chats.append(conv)
    return chats


def prompts(num: int, seed: int) -> list[tuple[Conversation, str]]:
    """`num` single-turn prompts (a user message, sometimes after a system message), each with the corpus answer."""
    rng = random.Random(seed)
    out: list[tuple[Conversation, str]] = []
    for _ in range(num):
        conv: Conversation = [{"role": "system", "content": _SYSTEM}] if rng.random() < 0.15 else []
        question, answer = _one_turn(rng)
        out.append(([*conv, {"role": "user", "content": question}], answer))
    return out


def tokenizer_texts(seed: int) -> list[str]:
    """Text the tokenizer's BPE merges are learned from: the corpus plus every number and letter spelled out."""
    rng = random.Random(seed)
    texts = [f"{m['role']}\n{m['content']}" for chat in training_chats(3000, seed) for m in chat]
    texts += [" ".join(str(i) for i in range(0, 100))] * 20
    texts += [" ".join(_LETTERS)] * 20
    rng.shuffle(texts)
    return texts
