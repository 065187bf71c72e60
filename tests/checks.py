"""Comparison helpers shared by the tests (run inside the ranks)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import tpcore
from rank_pool import IdleRank
from tpcore.models import GPTConfig

# Per-dtype tolerance, relative to the magnitude of the reference. fp32 differs from
# the dense reference only by summation order; bf16 rounds every partial sum that
# crosses a collective to 8 mantissa bits (eps = 2**-7 = 7.8e-3), so two roundings.
RTOL = {
    torch.float32: 1e-5,
    torch.float64: 1e-12,
    torch.bfloat16: 2 * 2**-7,
    torch.float16: 2 * 2**-10,
}


# Tiny GPTs shared by the model, generation and trainer tests.
GPT_VARIANTS = {
    # GPT-2 style: LayerNorm, GeLU, learned positions, tied embeddings, biases.
    "gpt2": GPTConfig(
        vocab_size=50,
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        max_position_embeddings=16,
        make_vocab_size_divisible_by=4,
    ),
    # Llama style: RMSNorm, SwiGLU, rotary, grouped-query attention, untied head, no biases.
    "llama": GPTConfig(
        vocab_size=50,
        num_layers=2,
        hidden_size=64,
        num_attention_heads=8,
        num_kv_heads=4,
        ffn_hidden_size=96,
        max_position_embeddings=16,
        norm="rmsnorm",
        activation="swiglu",
        position_embedding="rotary",
        tie_embeddings=False,
        bias=False,
        make_vocab_size_divisible_by=4,
    ),
}
# Llama's shape at its smallest: RMSNorm, SwiGLU, rotary, 2 KV heads of 8, no biases.
TINY_LLAMA = GPTConfig(
    vocab_size=64,
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=48,
    max_position_embeddings=32,
    norm="rmsnorm",
    activation="swiglu",
    position_embedding="rotary",
    bias=False,
    make_vocab_size_divisible_by=1,
)
# It with a dense first layer, then an MoE layer: 4 experts, top-2, a gated shared expert,
# balancing and z losses.
MOE_GPT = dataclasses.replace(
    TINY_LLAMA,
    max_position_embeddings=16,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=16,
    moe_shared_expert_intermediate_size=16,
    moe_shared_expert_gate=True,
    moe_layer_freq=[0, 1],
    moe_aux_loss_coeff=0.1,
    moe_z_loss_coeff=0.01,
)
# Llama style with fewer KV heads than TP ranks up to 4 (2 heads: replicated at TP 4;
# 1: at TP 2 and 4).
GQA_VARIANTS = {
    "llama_kv2": dataclasses.replace(GPT_VARIANTS["llama"], num_kv_heads=2),
    "llama_kv1": dataclasses.replace(GPT_VARIANTS["llama"], num_kv_heads=1),
    # Heads wider and narrower than hidden / heads (kv_channels, HF's head_dim:
    # Mistral-Nemo, Qwen3).
    "llama_wide_heads": dataclasses.replace(GPT_VARIANTS["llama"], kv_channels=16),
    "llama_kv2_narrow_heads": dataclasses.replace(
        GPT_VARIANTS["llama"], num_kv_heads=2, kv_channels=4
    ),
    # Qwen3's shape: q / k norms over each head, heads wider than hidden / heads.
    "qwen3": dataclasses.replace(GPT_VARIANTS["llama"], qk_norm=True, kv_channels=16),
    "qwen3_kv2": dataclasses.replace(GPT_VARIANTS["llama"], qk_norm=True, num_kv_heads=2),
    # OLMoE's attention: q / k norms over the whole projection, split over TP with the heads
    # (with two KV heads at TP 4: a k-norm slice copied on two ranks).
    "olmo": dataclasses.replace(GPT_VARIANTS["llama"], qk_norm=True, qk_norm_scope="projection"),
    "olmo_kv2": dataclasses.replace(
        GPT_VARIANTS["llama"], qk_norm=True, qk_norm_scope="projection", num_kv_heads=2
    ),
    # Gemma's shape: (1 + weight) norms, GeGLU, scaled embeddings, tied head, one KV head of 16.
    "gemma": dataclasses.replace(
        GPT_VARIANTS["llama"],
        norm="gemma_rmsnorm",
        activation="geglu",
        embedding_scale=8.0,
        tie_embeddings=True,
        num_kv_heads=1,
        kv_channels=16,
    ),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """`actual` equals `expected` up to the dtype's rounding, scaled by |expected|."""
    rtol = RTOL[expected.dtype]
    scale = expected.detach().abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(
        actual, expected, rtol=rtol, atol=rtol * max(scale, 1e-6), msg=lambda m: f"{what}: {m}"
    )


def setup_tp(tp: int, replicas: bool = False) -> tuple[int, int]:
    """Create groups for TP size `tp` on this rank; returns (tp_rank, tp_size).

    The other TP groups (data-parallel replicas) would check the same model on the same
    inputs, so only the first group (ranks 0 .. tp-1) goes on: the others raise `IdleRank`
    (unless `replicas`, for checks that use the data-parallel ranks, or every TP group)."""
    tpcore.initialize_model_parallel(tensor_parallel_size=tp)
    if not replicas and dist.get_rank() >= tp:
        raise IdleRank
    group = tpcore.parallel_state.get_tensor_model_parallel_group()
    return dist.get_rank(group), dist.get_world_size(group)


def per_rank_tensor(shape, rank: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """A tensor that differs by rank but that any rank can recompute."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(shape, generator=g).to(dtype)


def expect_error(exc_type: type[BaseException], match: str, fn, *args, **kwargs) -> None:
    """`fn` raises `exc_type` whose message contains `match`."""
    try:
        fn(*args, **kwargs)
    except exc_type as e:
        assert match in str(e), f"expected {match!r} in the error, got: {e}"
        return
    raise AssertionError(f"expected {exc_type.__name__} containing {match!r}, nothing was raised")


def reference_cross_entropy(logits, target, *, smoothing, ignore_index, reduction, z_loss):
    """Plain PyTorch: F.cross_entropy over logits [..., V] plus z_loss * logsumexp^2
    (F has no z-loss)."""
    import torch.nn.functional as F

    vocab = logits.shape[-1]
    flat, flat_target = logits.reshape(-1, vocab), target.reshape(-1)
    kwargs = dict(label_smoothing=smoothing, ignore_index=ignore_index)
    if z_loss == 0:
        loss = F.cross_entropy(flat, flat_target, reduction=reduction, **kwargs)
    else:
        kept = flat_target != ignore_index
        loss = F.cross_entropy(flat, flat_target, reduction="none", **kwargs)
        loss = loss + z_loss * torch.logsumexp(flat.float(), -1).square().to(loss.dtype) * kept
        loss = {"none": loss, "sum": loss.sum(), "mean": loss.sum() / kept.sum()}[reduction]
    return loss.view(target.shape) if reduction == "none" else loss


class LargestAllocation(TorchDispatchMode):
    """Records the largest storage (bytes) any op allocated while active: outputs of
    non-mutating ops whose storage is none of the inputs' (views, in-place ops and tensors
    rebuilt over a memory-mapped file allocate nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.is_mutable:
            return out

        def tensors(tree):
            return [
                t
                for t in tree_flatten(tree)[0]
                if isinstance(t, torch.Tensor) and t.device.type != "meta"
            ]

        inputs = {t.untyped_storage().data_ptr() for t in tensors((args, kwargs))}
        for t in tensors(out):
            if t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def gpt_rule(name: str, config: GPTConfig) -> tuple:
    """How GPTModel parameter `name` splits, written out here as the tests' reference (the
    library's own is the shard spec each parameter carries): `("parts", dim, sizes, units)`,
    `("vocab",)` or `("replicated",)`."""
    c = config
    if name in ("embedding.word.weight", "lm_head.weight"):
        return ("vocab",)
    if name.endswith(("attention.qkv.weight", "attention.qkv.bias")):
        heads = [c.num_attention_heads, c.num_kv_heads, c.num_kv_heads]
        return ("parts", 0, [n * c.head_dim for n in heads], heads)
    if name.endswith(("mlp.fc1.weight", "mlp.fc1.bias")):
        sizes = [c.ffn_hidden_size] * (2 if c.gated_mlp else 1)
        return ("parts", 0, sizes, sizes)
    if name.endswith(("q_norm.weight", "k_norm.weight")) and c.qk_norm_scope == "projection":
        heads = c.num_attention_heads if "q_norm" in name else c.num_kv_heads
        return ("parts", 0, [heads * c.head_dim], [heads])
    if name.endswith("attention.proj.weight"):
        return ("parts", 1, [c.num_attention_heads * c.head_dim], [c.num_attention_heads])
    if name.endswith("mlp.fc2.weight"):
        return ("parts", 1, [c.ffn_hidden_size], [c.ffn_hidden_size])
    return ("replicated",)


def param_specs(model) -> dict:
    """Every parameter's shard spec by name, over a model or a list of pipeline chunks."""
    from tpcore.tensor_parallel.shard_spec import shard_spec

    chunks = model if isinstance(model, (list, tuple)) else [model]
    return {n: shard_spec(p) for chunk in chunks for n, p in chunk.named_parameters()}


def _chunks(units: int, tp: int) -> int:
    """Chunks of a part of `units` heads at TP `tp`: one per rank, or one per head when
    there are fewer heads than ranks (each copied on tp // units adjacent ranks)."""
    return tp if units >= tp else units


def slice_piece(
    full: torch.Tensor, rule: tuple, rank: int, tp: int, config: GPTConfig, owned: bool = False
) -> torch.Tensor:
    """Rank's piece of a full tensor at TP size `tp`, by plain slicing (the reference for
    checkpoint resharding); vocabulary padding rows are zero. `owned`: zero the copies of
    replicated KV heads a lower rank holds too (a loader reads those from that rank)."""
    from tpcore.tensor_parallel.embedding import pad_vocab_size

    if rule[0] == "replicated":
        return full
    if rule[0] == "vocab":
        rows = pad_vocab_size(config.vocab_size, tp, config.make_vocab_size_divisible_by) // tp
        padded = torch.cat([full, full.new_zeros(rows * tp - full.shape[0], *full.shape[1:])])
        return padded.chunk(tp, 0)[rank]
    _, dim, sizes, units = rule
    pieces = []
    for part, u in zip(full.split(sizes, dim), units):
        n = _chunks(u, tp)
        piece = part.chunk(n, dim)[rank * n // tp]
        pieces.append(piece * 0 if owned and rank % (tp // n) else piece)
    return torch.cat(pieces, dim)


def merge_pieces(pieces: list[torch.Tensor], rule: tuple, config: GPTConfig) -> torch.Tensor:
    """The full tensor from every TP rank's piece, in rank order, by plain concatenation."""
    if rule[0] == "replicated":
        return pieces[0]
    if rule[0] == "vocab":
        return torch.cat(pieces, 0)[: config.vocab_size]
    _, dim, sizes, units = rule
    tp = len(pieces)
    counts = [_chunks(u, tp) for u in units]
    parts = [p.split([s // n for s, n in zip(sizes, counts)], dim) for p in pieces]
    # A replicated KV head: the copy of the first rank holding it.
    return torch.cat(
        [torch.cat([parts[j * tp // n][k] for j in range(n)], dim) for k, n in enumerate(counts)],
        dim,
    )


def ranks_sharing(
    full_shape, rule: tuple, rank: int, tp: int, saved_tp: int, config: GPTConfig
) -> list[int]:
    """The TP ranks at `saved_tp` whose piece shares an index with rank's piece at `tp`,
    found by slicing a tensor of index + 1 (0 marks padding); a replicated tensor (and a
    piece of padding only) is read from rank 0."""
    if rule[0] == "replicated":
        return [0]
    index = torch.arange(1, 1 + torch.Size(full_shape).numel()).view(full_shape)
    mine = set(slice_piece(index, rule, rank, tp, config).flatten().tolist()) - {0}
    return [
        r
        for r in range(saved_tp)
        if mine & set(slice_piece(index, rule, r, saved_tp, config, owned=True).flatten().tolist())
    ] or [0]
