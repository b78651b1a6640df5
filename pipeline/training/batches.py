"""Global training batches, by items or by tokens, the same at any process count, and each process's slice
of them."""

from __future__ import annotations

import random

from torch.utils.data import DataLoader


def bucket_batches(lengths: list[int], batch_size: int, seed: int, shuffle: bool) -> list[list[int]]:
    """Batches of similar-length items (less padding, shorter decoder loops), in random order.

    Items are shuffled, sorted by length inside windows of 50 batches, cut into batches, and the
    batches shuffled again; deterministic given ``seed``.
    """
    order = list(range(len(lengths)))
    rng = random.Random(seed)
    if shuffle:
        rng.shuffle(order)
    window = batch_size * 50
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: lengths[i])
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    if shuffle:
        rng.shuffle(batches)
    return batches


def token_batches(lengths: list[int], max_tokens: int, seed: int, shuffle: bool) -> list[list[int]]:
    """Batches of at most ``max_tokens`` padded tokens (items x the batch's longest length), cut from
    the whole set sorted by length, so a batch carries almost no padding.

    The cuts depend on the sorted lengths alone, so every epoch has the same number of batches of the
    same sizes (the schedule's step count is known up front); ties are broken by a ``seed``-shuffled
    order, so batch contents still change between epochs, and the batch order is shuffled. An item
    longer than ``max_tokens`` is a batch of its own. Deterministic given ``seed``.
    """
    order = list(range(len(lengths)))
    rng = random.Random(seed)
    if shuffle:
        rng.shuffle(order)
    order.sort(key=lambda i: lengths[i])  # stable: equal lengths keep the shuffled order
    batches, start = [], 0
    for n, i in enumerate(order):
        if n > start and lengths[i] * (n - start + 1) > max_tokens:  # ascending: lengths[i] is the longest
            batches.append(order[start:n])
            start = n
    batches.append(order[start:])
    if shuffle:
        rng.shuffle(batches)
    return batches


def epoch_batches(cfg, lengths: list[int], epoch: int) -> list[list[int]]:
    """The global training batches of ``epoch``: by tokens (``max_tokens``) or by items (``batch_size``)."""
    if cfg.max_tokens:
        return token_batches(lengths, cfg.max_tokens, cfg.seed + epoch, True)
    return bucket_batches(lengths, cfg.batch_size, cfg.seed + epoch, True)


def shard(batches: list[list[int]], rank: int, world: int, fill: bool = True) -> list[list[int]]:
    """This process's contiguous slice of every global batch.

    With ``fill`` (training) a global batch smaller than ``world`` is repeated to fill every
    slice: a process with an empty slice would leave the others waiting in the gradient
    all-reduce. Without it (validation, no collective per batch) such slices stay empty.
    """
    if world == 1:
        return batches
    out = []
    for b in batches:
        if fill and len(b) < world:
            b = (b * world)[:world]
        out.append(b[rank * len(b) // world : (rank + 1) * len(b) // world])
    return out


def make_loader(task, items: list, batches: list[list[int]]) -> DataLoader:
    # Creating an iterator of this loader draws one seed from torch's global RNG (DataLoader's
    # base seed); resume relies on that happening at the same point as in an uninterrupted run.
    return DataLoader(items, batch_sampler=batches, collate_fn=task.collate)
