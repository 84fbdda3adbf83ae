"""Training loop of the tiny target: next-token loss on whole chats, reproducible on any CPU.

Kept apart from `tiny` (builders and generation) so each stays small; nothing here reads or writes files.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from dflash.shards.progress import ProgressLine

if TYPE_CHECKING:
    from .tiny import TinySize


def train_on_chats(
    model, token_rows: list[list[int]], pad_id: int, size: TinySize, seed: int
) -> tuple[float, float]:
    """Next-token training on whole chats; returns (first, final) smoothed loss.

    Batches are drawn from length-sorted windows (little padding) and right-padded without an
    attention mask: under a causal mask pad tokens at the end only see, never feed, real tokens.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)

    def epoch_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
        # Shuffle, then sort by length within windows of 8 batches: batches stay mixed across tasks
        # (all-one-length batches trained measurably worse) while padding stays small.
        order = torch.randperm(len(token_rows), generator=generator).tolist()
        window = 8 * size.batch_size
        batches = []
        for w in range(0, len(order), window):
            group = sorted(order[w : w + window], key=lambda i: len(token_rows[i]))
            batches += [group[i : i + size.batch_size] for i in range(0, len(group), size.batch_size)]
        tensors = []
        for b in torch.randperm(len(batches), generator=generator).tolist():
            rows = [token_rows[i] for i in batches[b]]
            ids = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long)
            for j, row in enumerate(rows):
                ids[j, : len(row)] = torch.tensor(row)
            tensors.append((ids, ids.masked_fill(ids == pad_id, -100)))
        return tensors

    optimizer = torch.optim.AdamW(model.parameters(), lr=size.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, size.train_steps // 10)

    def lr_factor(step: int) -> float:  # linear warmup, cosine down to 10%
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, size.train_steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    first = smoothed = float("nan")
    progress = ProgressLine("target LM", size.train_steps, "step")  # minutes on a loaded 2-core box
    model.train()
    for step in range(size.train_steps):
        if not pending:
            pending = epoch_batches()[::-1]
        input_ids, labels = pending.pop()
        loss = model(input_ids=input_ids, labels=labels, use_cache=False).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        value = loss.item()
        first = value if step == 0 else first
        smoothed = value if step == 0 else 0.9 * smoothed + 0.1 * value
        progress.set_postfix(loss=f"{smoothed:.3f}")
        progress.update(1)
    progress.close()
    model.eval()
    return first, smoothed


@contextlib.contextmanager
def reproducible_torch() -> Iterator[None]:
    """One CPU thread and deterministic kernels, restored afterwards.

    One thread makes the weights independent of the core count, and on a shared 2-core box two
    spinning OpenMP threads ran 27x slower than one (4.6 vs 0.17 s/step, measured). NaN-filling of
    fresh tensors (on by default under deterministic mode) is turned off: it alone costs ~7x.
    """
    import torch

    threads = torch.get_num_threads()
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_filling = torch.utils.deterministic.fill_uninitialized_memory
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(was_deterministic)
        torch.utils.deterministic.fill_uninitialized_memory = was_filling
