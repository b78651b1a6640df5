"""Greedy decoding, the one loop every sequence model's ``predict`` runs.

The served loop over the exported step graphs is ``serving.decode.greedy``; the export stage holds
the two to the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def greedy(step: Callable[[Tensor], tuple[Tensor, dict[str, Tensor]]], rows: int, device: torch.device,
           cfg: Any) -> dict[str, Tensor]:
    """Decode a batch one token at a time, taking the highest-scoring token each step.

    Args:
        step: ``step(y_prev)`` -> (scores [B,V] of the next token, logits or log-probabilities,
            and ``{name: [B,...]}``, what to keep of this step); it carries the decoder's state itself.
        rows / device: the batch size B and where it lives.
        cfg: the model's config: ``bos_id`` (the first ``y_prev``), ``eos_id`` (the token that ends a
            row), ``pad_id`` (emitted after it) and ``max_len`` (the most steps, EOS included).

    Returns: tokens [B,T] (EOS-terminated, pad after), lengths [B] (tokens before EOS; ``max_len``
        for a row that never emitted it) and every kept name [B,T,...]. Stops once every row ended.
    """
    y = torch.full((rows,), cfg.bos_id, dtype=torch.long, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    lengths = torch.full((rows,), cfg.max_len, dtype=torch.long, device=device)
    tokens, kept = [], {}
    for t in range(cfg.max_len):
        scores, outputs = step(y)
        y = torch.where(done, torch.full_like(y, cfg.pad_id), scores.argmax(-1))
        tokens.append(y)
        for name, value in outputs.items():
            kept.setdefault(name, []).append(value)
        newly = (y == cfg.eos_id) & ~done
        lengths = torch.where(newly, torch.full_like(lengths, t), lengths)
        done = done | newly
        if bool(done.all()):
            break
    return {"tokens": torch.stack(tokens, dim=1),  # T x [B] -> [B,T]
            "lengths": lengths,
            **{name: torch.stack(values, dim=1) for name, values in kept.items()}}  # T x [B,...] -> [B,T,...]
