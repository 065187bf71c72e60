"""Autoregressive sampling from a `GPTModel` (tensor parallel) or a `ReferenceGPT`.

No KV cache: every step recomputes the window of the last `max_position_embeddings`
tokens. With a `GPTModel` this is a collective: call it on every TP rank with the same
arguments; all of them return the same tokens (the gathered logits are identical on
every rank and each rank samples from its own generator seeded with `seed`).
With `sequence_parallel` the window is right-padded to a multiple of the TP size:
attention is causal, so padding after the last token leaves its logits unchanged.
"""

from __future__ import annotations

import torch

from .. import comm
from .gpt import GPTModel

__all__ = ["generate"]


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


def _last_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits `[b, vocab]` for the last position of `ids`."""
    c, n = model.config, ids.shape[1]
    if not isinstance(model, GPTModel):
        return model(ids)[:, -1, : c.vocab_size]
    # right-pad: causal, so the last real token's logits hold
    if c.sequence_parallel and n % model.tp_size:
        ids = torch.cat([ids, ids.new_zeros(ids.shape[0], model.tp_size - n % model.tp_size)], 1)
    shard = model(ids)[:, n - 1].contiguous()  # [b, vocab_padded / tp]
    return comm.all_gather(shard, -1, model.group)[:, : c.vocab_size]


def generate(
    model,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    greedy: bool = False,
    seed: int = 0,
    eod: int | None = None,
) -> torch.Tensor:
    """`prompt [batch, t]` int64 -> `[batch, t + new]`, new <= max_new_tokens (fewer when every
    sequence has emitted `eod`; a finished sequence is padded with `eod`)."""
    _check(model, prompt, max_new_tokens, temperature, top_k, eod)
    device = next(model.parameters()).device
    tokens, window = prompt.to(device), model.config.max_position_embeddings
    generator = torch.Generator(device=device).manual_seed(seed)
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(max_new_tokens):
                logits = _last_logits(model, tokens[:, -window:]).float()
                if greedy:
                    nxt = logits.argmax(-1)
                else:
                    logits = logits / temperature
                    if top_k is not None and top_k < logits.shape[-1]:
                        kth = logits.topk(top_k, -1).values[:, -1:]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)
                if eod is not None:
                    nxt = nxt.masked_fill(done, eod)
                    done |= nxt == eod
                tokens = torch.cat([tokens, nxt.unsqueeze(1)], 1)
                if eod is not None and bool(done.all()):
                    break
    finally:
        model.train(was_training)
    return tokens
