"""The drafter's mask token id: the default (the first embedding row no token uses) and the refusal of an id
the tokenizer gives to text.

DFlash fills block slots 1..B-1 with `mask_token_id` and embeds them with the target's frozen table, so the id
must mean "masked" and nothing else: with a text token's id every masked slot reads as that token (the anchor
slot may hold the very same token), and serving engines fill blocks with the same id, so the drafter is served
the ambiguity it was trained on. What is left to choose from: rows past the tokenizer (Qwen3: 151669 of
151936 rows, the default) and the tokenizer's special tokens (reserved ids, for a table the tokenizer fills).
An id copied from another target is the usual mistake: Qwen3's 151669 is an ordinary token of a larger
tokenizer. Only `CACHE/target/tokenizer.json` is read (as the default already does); without one, the
vocabulary range (`load_frozen_target`) is all that can be checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash.shards.errors import ShardError
from dflash.shards.safe_io import read_json

MAX_TOKENIZER_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class TokenizerIds:
    """The ids a tokenizer emits: its model's vocabulary (text pieces) and its added tokens (special or not)."""

    vocab: dict[int, str]
    added: dict[int, tuple[str, bool]]  # id -> (content, special)

    @property
    def size(self) -> int:
        """max id + 1: len(tokenizer) when ids are contiguous (Qwen3: 151669), and always an unused id."""
        return max([*self.vocab, *self.added], default=-1) + 1

    def text_token(self, token_id: int) -> str | None:
        """The token `token_id` stands for in text (a vocabulary piece or a non-special added token), or None
        when it is unused or a special token."""
        if token_id in self.added:
            content, special = self.added[token_id]
            return None if special else content
        return self.vocab.get(token_id)


def read_tokenizer_ids(target_dir: str | Path) -> TokenizerIds | None:
    """The ids of `target_dir/tokenizer.json` (BPE, WordPiece and WordLevel map pieces to ids; Unigram lists
    pieces in id order); None without the file. Vocabulary pieces that tokenizer_config.json names as special
    tokens (`pad_token: "<pad>"`, ...) count as special, as transformers counts them."""
    target_dir = Path(target_dir)
    path = target_dir / "tokenizer.json"
    if not path.is_file():
        return None
    data = read_json(path, max_bytes=MAX_TOKENIZER_BYTES)  # depth-limited; a FIFO is refused, not waited on
    try:
        vocab = data.get("model", {}).get("vocab") or {}
        if isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the position
            pieces = {i: str(entry[0]) for i, entry in enumerate(vocab)}
        else:
            pieces = {int(i): str(piece) for piece, i in vocab.items()}
        added = {
            int(t["id"]): (str(t["content"]), bool(t.get("special"))) for t in data.get("added_tokens", [])
        }
        named = _named_special_tokens(target_dir / "tokenizer_config.json")
    except (ValueError, TypeError, KeyError, AttributeError, IndexError) as exc:
        raise ShardError(f"{path}: unreadable tokenizer ({exc!r:.200})") from None
    for i, piece in pieces.items():
        if piece in named and i not in added:
            added[i] = (piece, True)
    return TokenizerIds(pieces, added)


_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _named_special_tokens(path: Path) -> set[str]:
    """The special tokens tokenizer_config.json names (each a string or {"content": ...}); none without it."""
    if not path.is_file():
        return set()
    config = read_json(path, max_bytes=MAX_TOKENIZER_BYTES)
    values = [config.get(key) for key in _NAMED_SPECIAL] + list(config.get("additional_special_tokens") or [])
    return {str(v["content"]) if isinstance(v, dict) else v for v in values if isinstance(v, (str, dict))}


def default_mask_token_id(target_dir: str | Path, vocab_size: int) -> int | None:
    """The first embedding row no token uses, when the table is padded past the tokenizer; else None."""
    ids = read_tokenizer_ids(target_dir)
    if ids is None or ids.size >= vocab_size:
        return None
    return ids.size


def check_mask_token_id(target_dir: str | Path, mask_token_id: int, vocab_size: int) -> None:
    """Refuse (ValueError, one line) a mask token id the tokenizer uses for text; unused rows and special
    tokens pass, and so does any id when the target ships no tokenizer.json."""
    ids = read_tokenizer_ids(target_dir)
    token = ids.text_token(mask_token_id) if ids is not None else None
    if token is None:
        return
    free = ids.size if ids.size < vocab_size else None
    instead = (
        f"leave it unset for the first unused row, {free}" if free is not None else "pick a special token"
    )
    raise ValueError(
        f"mask_token_id {mask_token_id} (--mask-token-id) is the text token {token!r} of "
        f"{Path(target_dir) / 'tokenizer.json'}: every masked block slot would read as that token; {instead}"
    )
