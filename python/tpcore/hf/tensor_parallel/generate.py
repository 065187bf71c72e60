"""Generation from a `tpcore.hf` model with the LM head kept vocab-parallel: no rank ever
holds `[batch, vocab]` logits (`tensor_parallel.sampling` picks the tokens). The model runs
with its KV cache (`past_key_values`), one token per step after the prompt.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ...tensor_parallel.sampling import check_sampling_args, next_token
from .lm_head import VocabParallelLMHead, local_logits

__all__ = ["generate"]


def _check(input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, head) -> None:
    """Checks that raise alike on every rank, before any collective."""
    what = "tpcore.hf.generate:"
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ValueError(
            f"{what} input_ids must be a non-empty [batch, seq] tensor, got "
            f"{getattr(input_ids, 'shape', input_ids)!r}"
        )
    if input_ids.dtype != torch.int64:
        raise ValueError(f"{what} input_ids must be int64, got {input_ids.dtype}")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= head.vocab_size:
        raise ValueError(
            f"{what} token id {lo if lo < 0 else hi} is outside [0, {head.vocab_size})"
        )
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"{what} attention_mask shape {list(attention_mask.shape)} != input_ids shape "
            f"{list(input_ids.shape)}"
        )
    check_sampling_args(what, max_new_tokens, temperature, top_k)
    if not 0 < top_p <= 1:
        raise ValueError(f"{what} top_p must be in (0, 1], got {top_p!r}")


def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int = 20,
    attention_mask: torch.Tensor | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = 50,
    top_p: float = 1.0,
    seed: int = 0,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
) -> torch.Tensor:
    """`input_ids [b, t]` -> `[b, t + n]`, n <= max_new_tokens, from a model made by
    `tpcore.hf.parallelize` / `from_pretrained`. Call on every TP rank with the same
    arguments; every rank returns the same ids. Greedy by default; `do_sample=True` draws
    from temperature / top-k / top-p (`top_k=None`: the whole vocabulary, gathered). With
    `eos_token_id` (one id or several), finished rows are padded with `pad_token_id`
    (default: the first eos id) and
    generation stops once every row has finished. `attention_mask` marks left padding.
    """
    head = next((m for m in model.modules() if isinstance(m, VocabParallelLMHead)), None)
    if head is None:
        raise ValueError(
            f"tpcore.hf.generate: {type(model).__name__} has no vocab-parallel LM head; "
            "parallelize it first"
        )
    _check(input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, head)
    device = head.weight.device
    tokens = input_ids.to(device)
    mask = (
        torch.ones_like(tokens)
        if attention_mask is None
        else attention_mask.to(device=device, dtype=torch.long)
    )
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    accepted = inspect.signature(model.forward).parameters
    keep_last = {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}
    if "output_router_logits" in accepted:  # MoE: no load-balancing loss while decoding
        keep_last["output_router_logits"] = False
    generator = torch.Generator(device=device).manual_seed(seed)
    done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=device)
    eos = (
        None
        if eos_token_id is None
        else torch.tensor(
            [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=device
        )
    )
    pad = (None if eos is None else int(eos[0])) if pad_token_id is None else pad_token_id
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), local_logits(model):
            out = model(
                input_ids=tokens,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **keep_last,
            )
            for step in range(max_new_tokens):
                nxt = next_token(
                    out.logits[:, -1, :],
                    head.vocab_start,
                    head.vocab_size,
                    head.group,
                    greedy=not do_sample,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    generator=generator,
                )
                if eos is not None:
                    nxt = nxt.masked_fill(done, pad)
                    done |= torch.isin(nxt, eos)
                tokens = torch.cat([tokens, nxt.unsqueeze(1)], 1)
                if step + 1 == max_new_tokens or (eos is not None and bool(done.all())):
                    break
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
                positions = positions[:, -1:] + 1
                out = model(
                    input_ids=nxt.unsqueeze(1),
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=out.past_key_values,
                    use_cache=True,
                    **keep_last,
                )
    finally:
        model.train(was_training)
    return tokens
