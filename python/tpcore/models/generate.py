"""Autoregressive sampling from a `GPTModel` (tensor parallel) or a `ReferenceGPT`.

A `GPTModel` decodes with a KV cache (`GPTModel.decode`): the prompt once, then one token
per step. Tokens are picked from the vocab-parallel logits (`tensor_parallel.sampling`:
no rank holds `[batch, vocab]` logits), the same on every rank, so this is a collective:
call it on every TP rank with the same arguments. Past `max_position_embeddings` tokens,
and for a `ReferenceGPT` or with `sequence_parallel`, each step recomputes the window of
the last `max_position_embeddings` tokens instead; with `sequence_parallel` that window is
right-padded to a multiple of the TP size (attention is causal, so padding after the last
token leaves its logits unchanged).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..tensor_parallel.sampling import check_sampling_args, next_token
from .gpt import GPTModel
from .kv_cache import KVCache

__all__ = ["generate"]


def _check(model, prompt, max_new_tokens, temperature, top_k, eod) -> None:
    """Every check runs before any collective, alike on all ranks: no rank hangs."""
    c, what = model.config, "tpcore: generate:"
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2:
        raise ValueError(
            f"{what} prompt must be a 2-D [batch, seq] tensor, "
            f"got shape {list(getattr(prompt, 'shape', []))}"
        )
    if prompt.dtype != torch.int64:
        raise ValueError(f"{what} prompt must be int64 token ids, got {prompt.dtype}")
    if prompt.numel() == 0:
        raise ValueError(f"{what} prompt is empty (shape {list(prompt.shape)})")
    check_sampling_args(what, max_new_tokens, temperature, top_k)
    lo, hi = prompt.min().item(), prompt.max().item()
    if lo < 0 or hi >= c.vocab_size:
        raise ValueError(
            f"{what} prompt token id {lo if lo < 0 else hi} is out of range [0, {c.vocab_size})"
        )
    if eod is not None and not 0 <= eod < c.vocab_size:
        raise ValueError(f"{what} eod {eod} is out of range [0, {c.vocab_size})")
    if isinstance(model, GPTModel) and c.sequence_parallel and max_new_tokens:
        tp, window = (
            model.tp_size,
            min(prompt.shape[1] + max_new_tokens - 1, c.max_position_embeddings),
        )
        if -(-window // tp) * tp > c.max_position_embeddings:
            raise ValueError(
                f"{what} with sequence_parallel a window of {window} tokens must "
                f"be padded to a multiple of the tensor-parallel size {tp}, which "
                f"exceeds max_position_embeddings {c.max_position_embeddings}"
            )


def _recomputed_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """This rank's logits `[b, vocab(_padded / tp)]` of the last position of `ids`, from a
    forward over all of them."""
    n = ids.shape[1]
    if not isinstance(model, GPTModel):
        return model(ids)[:, -1]
    # right-pad: causal, so the last real token's logits hold
    if model.config.sequence_parallel and n % model.tp_size:
        ids = torch.cat([ids, ids.new_zeros(ids.shape[0], model.tp_size - n % model.tp_size)], 1)
    return model(ids)[:, n - 1]


def _all_done(done: torch.Tensor, expert_group) -> bool:
    """Whether every sequence has finished here and, with an expert group, on its ranks."""
    finished = done.all().to(torch.int32)
    if expert_group is not None and dist.get_world_size(expert_group) > 1:
        dist.all_reduce(finished, op=dist.ReduceOp.MIN, group=expert_group)
    return bool(finished)


def generate(
    model,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    greedy: bool = False,
    seed: int = 0,
    eod: int | None = None,
) -> torch.Tensor:
    """`prompt [batch, t]` int64 -> `[batch, t + new]`, new <= max_new_tokens (fewer when every
    sequence has emitted `eod`; a finished sequence is padded with `eod`). Sampling draws
    from temperature / top-k / top-p (`top_k=None`: the whole vocabulary); `greedy` takes
    the most likely token."""
    _check(model, prompt, max_new_tokens, temperature, top_k, eod)
    if not 0 < top_p <= 1:
        raise ValueError(f"tpcore: generate: top_p must be in (0, 1], got {top_p!r}")
    c, device = model.config, next(model.parameters()).device
    tokens, window = prompt.to(device), c.max_position_embeddings
    tp = isinstance(model, GPTModel)
    group = model.group if tp else None
    vocab_start = model.tp_rank * model.head_weight().shape[0] if tp else 0
    cache = KVCache(window) if tp and not c.sequence_parallel else None
    generator = torch.Generator(device=device).manual_seed(seed)
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=device)
    # MoE at EP > 1: the ranks of the expert group exchange tokens at every step, so they
    # stop together (each may hold other sequences).
    experts = getattr(model, "expert_group", None) if tp else None
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            fresh = tokens  # the tokens the cache has not seen
            for _ in range(max_new_tokens):
                if cache is not None and cache.length + fresh.shape[1] <= window:
                    local = model.decode(fresh, cache)
                else:  # past the positions the model has: recompute the last window
                    cache, local = None, _recomputed_logits(model, tokens[:, -window:])
                nxt = next_token(
                    local,
                    vocab_start,
                    c.vocab_size,
                    group,
                    greedy=greedy,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    generator=generator,
                )
                fresh = nxt.unsqueeze(1)
                if eod is not None:
                    nxt = nxt.masked_fill(done, eod)
                    done |= nxt == eod
                tokens = torch.cat([tokens, nxt.unsqueeze(1)], 1)
                if eod is not None and _all_done(done, experts):
                    break
    finally:
        model.train(was_training)
    return tokens
