"""Picking the next token from vocab-parallel logits, the same on every rank, without any
rank holding `[batch, vocab]` logits: `tpcore.models.generate` (GPTModel, ReferenceGPT)
and `tpcore.hf.generate` use it.

Greedy decoding takes each rank's best (logit, id) and all-gathers those `[tp, batch]`
pairs; sampling all-gathers each rank's top-k candidates `[tp, batch, k]` (the whole
vocabulary with `top_k=None`), then every rank applies temperature, top-k and top-p (as
transformers' logits warpers do) to the same candidates, sorted by id, and draws with the
same seeded generator, so all ranks pick the same token. With one rank (`group` None or of
size 1) nothing is gathered and the result is the same function of the logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm

__all__ = [
    "check_sampling_args",
    "select_greedy",
    "candidates",
    "filtered_probs",
    "next_token",
]


def check_sampling_args(
    what: str, max_new_tokens: int, temperature: float, top_k: int | None
) -> None:
    """The sampling options every generator takes; raises a ValueError prefixed by `what`."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"{what} max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not temperature > 0:
        raise ValueError(f"{what} temperature must be > 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"{what} top_k must be an int >= 1 or None, got {top_k!r}")


def _gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return t
    return comm.all_gather(t, dim, group)


def select_greedy(local: torch.Tensor, vocab_start: int, group) -> torch.Tensor:
    """Global argmax ids `[b]` from this rank's logits `[b, rows]` whose first column is id
    `vocab_start` (ties: the smallest id, as torch.argmax)."""
    value, index = local.max(-1)
    pairs = torch.stack(
        [value.double(), (index + vocab_start).double()], -1
    )  # ids < 2**53 are exact
    gathered = _gather(pairs.unsqueeze(0), 0, group)  # [tp, b, 2]
    best = gathered[..., 0].argmax(0)  # the first rank holding the maximum
    return gathered[..., 1].gather(0, best.unsqueeze(0)).squeeze(0).long()


def candidates(
    local: torch.Tensor, vocab_start: int, group, top_k: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, ids), both `[b, c]` and the same on every rank: the `top_k` best of the
    whole vocabulary (each rank offers its own `top_k` best), or with `top_k=None` every id
    (a full gather); vocabulary padding (`-inf` logits) left out. So `c` does not depend on
    the TP size, nor on padding: a draw from them is the same at any TP size. (Ties at the
    k-th logit: one of them, the same on every rank.)"""
    k = local.shape[-1] if top_k is None else min(top_k, local.shape[-1])
    values, index = local.topk(k, -1)
    pairs = torch.stack([values.double(), (index + vocab_start).double()], -1)
    gathered = _gather(pairs, 1, group)  # [b, tp*k, 2]
    logits, ids = gathered[..., 0].to(local.dtype), gathered[..., 1].long()
    real = int((logits[0] != float("-inf")).sum())  # padding: the same columns in every row
    keep = real if top_k is None else min(top_k, real)
    if keep < logits.shape[-1]:
        logits, order = logits.topk(keep, -1)
        ids = ids.gather(-1, order)
    return logits, ids


def filtered_probs(
    logits: torch.Tensor, ids: torch.Tensor, *, temperature: float, top_k: int | None, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, probabilities), `[b, c]`, ids in ascending order: the candidates' distribution
    after temperature, top-k (ties at the k-th logit kept) and top-p (the smallest set whose
    probability exceeds `top_p`, at least one token), as transformers' Temperature-, TopK-
    and TopPLogitsWarper do on the full logits. Sorting by id makes the draw independent
    of the order the candidates were gathered in."""
    ids, order = ids.sort(-1)
    logits = logits.gather(-1, order).float() / temperature
    logits = logits.masked_fill(ids < 0, float("-inf"))
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_index = logits.sort(-1)  # ascending
        remove = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
        remove[..., -1] = False  # keep at least the most likely
        logits = logits.masked_fill(remove.scatter(-1, sorted_index, remove), float("-inf"))
    return ids, logits.softmax(-1)


def next_token(
    local: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    group,
    *,
    greedy: bool,
    temperature: float,
    top_k: int | None,
    top_p: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """The next ids `[b]` from this rank's logits `[b, rows]` of ids `[vocab_start,
    vocab_start + rows)` (ids from `vocab_size` on are vocabulary padding, never picked)."""
    local = local.to(torch.float32, copy=True)  # the caller's logits stay as they are
    local[:, max(0, vocab_size - vocab_start) :] = float("-inf")
    if greedy:
        return select_greedy(local, vocab_start, group)
    logits, ids = candidates(local, vocab_start, group, top_k)
    ids, probs = filtered_probs(logits, ids, temperature=temperature, top_k=top_k, top_p=top_p)
    return ids.gather(-1, torch.multinomial(probs, 1, generator=generator)).squeeze(-1)
