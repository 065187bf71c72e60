"""A tensor-parallel GPT built from tpcore's layers (Megatron-LM's layout).

Attention (`parallel_attention.py`): a column-parallel QKV projection holding whole heads of
this rank, causal attention, a row-parallel output projection. MLP: column -> GeLU / SwiGLU ->
row; or a mixture of experts (`tpcore.moe`). Vocab-parallel
embedding, LM head tied to it by default, loss through the vocab-parallel cross-entropy
(optionally fused with the head). Dropout masks come from the RNG tracker's counter streams
(`tracked_dropout`), so they trace under torch.compile.
With `sequence_parallel`, norms, dropout and residuals hold `[s/tp, b, h]`; the
column layers all-gather the sequence and the row layers reduce-scatter it.
With a context-parallel group each rank holds `s/cp` tokens of every sequence (the
load-balanced chunks of `tpcore.context_parallel`), at their true positions, and attention
crosses the group (`context_parallel_attention`).
Activations are `[seq, batch, hidden]` inside; inputs are ids `[batch, seq]`.
"""

from __future__ import annotations

import dataclasses
import re
from functools import partial
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import _op_entry
from .._module_utils import (
    SharesProcessGroups,
    meta_embedding,
    to_empty,
    to_empty_keeping_attributes,
)
from ..context_parallel import check_sequence
from ..context_parallel import positions as context_positions
from ..moe import MoELayer, reset_expert_biases
from ..parallel_state import (
    get_context_parallel_group,
    get_expert_model_parallel_group,
    get_tensor_context_parallel_group,
    is_initialized,
    live_group_name,
    resolve_tensor_group,
)
from ..tensor_parallel.adapters import lora_adapters
from ..tensor_parallel.dropout import region_dropout
from ..tensor_parallel.embedding import VocabParallelEmbedding, pad_vocab_size
from ..tensor_parallel.initialization import draw_seed
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.loss import vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy
from ..tensor_parallel.mappings import (
    gather_from_sequence_parallel,
    reduce_from_tensor_parallel,
)
from ..tensor_parallel.random import MODEL_PARALLEL_RNG, REPLICATED_RNG, get_rng_tracker
from ..tensor_parallel.recompute import checkpoint
from ..tensor_parallel.scaled_embedding import ScaledVocabParallelEmbedding
from ..tensor_parallel.shard_spec import set_shard_spec, shard, unshard
from ..tensor_parallel.shared_grads import sum_partial_grads
from .common import (
    make_norm,
    mlp_activation,
    rotary_tables,
)
from .config import GPTConfig
from .gpt_specs import gpt_shard_specs
from .initialization import initialize_gpt_parameters
from .kv_cache import KVCache
from .moe_block import moe_config
from .parallel_attention import ParallelAttention
from .reference_gpt import ReferenceGPT

__all__ = ["GPTModel", "finalize_sequence_parallel_grads", "attach_gpt_shard_specs"]


def _dropout(dropout: nn.Dropout, x: torch.Tensor, per_tp_rank: bool) -> torch.Tensor:
    """`dropout` applied through `region_dropout` (its masks per TP rank or replicated)."""
    return region_dropout(x, dropout.p, dropout.training, per_tp_rank)


def _create_dropout_counters(device: torch.device) -> None:
    """Create the dropout streams' counters on `device` outside the recomputed regions:
    torch.compile cannot create state inside a torch.utils.checkpoint region."""
    tracker = get_rng_tracker()
    for stream in (MODEL_PARALLEL_RNG, REPLICATED_RNG):
        if tracker.has_counter(stream):
            tracker.counter(stream, device)


def _mark_sequence_parallel(*params: nn.Parameter | None) -> None:
    """Tag parameters replicated over TP that see only this rank's sequence shard."""
    for p in params:
        if p is not None:
            p.sequence_parallel = True


class ParallelMLP(nn.Module):
    def __init__(
        self,
        config: GPTConfig,
        group: dist.ProcessGroup,
        dtype: torch.dtype | None,
        ffn: int | None = None,
    ) -> None:
        super().__init__()
        c = self.config = config
        ffn = c.ffn_hidden_size if ffn is None else ffn
        common = dict(
            bias=c.mlp_bias,
            sequence_parallel=c.sequence_parallel,
            group=group,
            dtype=dtype,
            device="meta",
        )
        self.fc1 = ColumnParallelLinear(c.hidden_size, ffn * (2 if c.gated_mlp else 1), **common)
        self.fc2 = RowParallelLinear(ffn, c.hidden_size, input_is_parallel=True, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(mlp_activation(self.config, self.fc1(x)))


def _moe_mlp(
    config: GPTConfig,
    group: dist.ProcessGroup,
    expert_group: dist.ProcessGroup | None,
    dtype: torch.dtype | None,
    token_group: dist.ProcessGroup | None,
) -> MoELayer:
    shared = config.moe_shared_expert_intermediate_size
    layer = MoELayer(
        moe_config(config),
        group=group,
        expert_group=expert_group,
        dtype=dtype,
        shared_expert=None if shared is None else ParallelMLP(config, group, dtype, shared),
        token_group=token_group,
    )
    # Each TP rank routes its own tokens: the router's gradient is a share per rank, and so
    # are the experts' when every rank holds every expert (at EP > 1 the expert-data-parallel
    # group sums them). The shared-expert gate sees this rank's sequence shard under SP.
    ep = 1 if expert_group is None else dist.get_world_size(expert_group)
    _mark_sequence_parallel(layer.router.weight)
    if ep == 1:
        _mark_sequence_parallel(*layer.experts.parameters())
    if config.sequence_parallel and config.moe_shared_expert_gate:
        _mark_sequence_parallel(layer.shared_expert_gate.weight)
    return layer


class ParallelBlock(nn.Module):
    def __init__(
        self,
        config: GPTConfig,
        group: dist.ProcessGroup,
        dtype: torch.dtype | None,
        index: int = 0,
        expert_group: dist.ProcessGroup | None = None,
        context_group: dist.ProcessGroup | None = None,
        token_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.input_norm = make_norm(config, dtype, "meta")
        self.attention = ParallelAttention(config, group, dtype, context_group)
        self.post_attention_norm = make_norm(config, dtype, "meta")
        self.mlp = (
            _moe_mlp(config, group, expert_group, dtype, token_group)
            if config.is_moe_layer(index)
            else ParallelMLP(config, group, dtype)
        )
        self.dropout = nn.Dropout(config.dropout)
        self.sequence_parallel = config.sequence_parallel
        if config.sequence_parallel:
            _mark_sequence_parallel(
                *self.input_norm.parameters(), *self.post_attention_norm.parameters()
            )

    def forward(
        self, x: torch.Tensor, rope, cache: tuple[KVCache, int] | None = None
    ) -> torch.Tensor:
        sp = self.sequence_parallel
        x = x + _dropout(self.dropout, self.attention(self.input_norm(x), rope, cache), sp)
        return x + _dropout(self.dropout, self.mlp(self.post_attention_norm(x)), sp)


class ParallelEmbedding(SharesProcessGroups, nn.Module):
    """Word (vocab-parallel) plus learned positions; `[b, s]` ids -> `[s(/tp), b, h]`."""

    def __init__(
        self, config: GPTConfig, group: dist.ProcessGroup, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        self.config, self.group = config, group
        scaled = config.embedding_scale is not None  # Gemma's: the lookup times a constant
        self.word = (ScaledVocabParallelEmbedding if scaled else VocabParallelEmbedding)(
            config.vocab_size,
            config.hidden_size,
            make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
            sequence_parallel=config.sequence_parallel,
            group=group,
            dtype=dtype,
            device="meta",
            **({"embed_scale": config.embedding_scale} if scaled else {}),
        )
        if config.position_embedding == "learned":
            self.position = meta_embedding(
                config.max_position_embeddings, config.hidden_size, dtype
            )
            if config.sequence_parallel:
                _mark_sequence_parallel(self.position.weight)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self, ids: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`ids [b, s]` at positions `start..start + s - 1` (or `positions [s]`) ->
        `[s(/tp), b, h]`."""
        x = self.word(ids.t())
        if hasattr(self, "position"):
            pos = (
                self.position.weight[start : start + ids.shape[1]]
                if positions is None
                else self.position.weight.index_select(0, positions)
            )
            if self.config.sequence_parallel:  # this rank's sequence shard of the positions
                tp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
                pos = pos.chunk(tp, 0)[rank]
            x = x + pos.unsqueeze(1)
        return _dropout(self.dropout, x, self.config.sequence_parallel)


class _TiedHeadWeight(SharesProcessGroups, nn.Module):
    """The last pipeline stage's copy of the word embedding, for the tied LM head: named
    `embedding.word.weight` as on the first stage (the embedding group keeps them equal)."""

    def __init__(
        self, config: GPTConfig, group: dist.ProcessGroup, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        self.word = VocabParallelEmbedding(
            config.vocab_size,
            config.hidden_size,
            make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
            group=group,
            dtype=dtype,
            device="meta",
        )


class LayerStack(nn.ModuleList):
    """Transformer blocks under their global layer index (`layers.7.…` on a pipeline stage
    holding layers 6 and 7), so a stage's state dict is a subset of the full model's."""

    def __init__(self, blocks: dict[int, nn.Module]) -> None:
        super().__init__()
        for index, block in blocks.items():
            self.add_module(str(index), block)

    def __getitem__(self, index: int) -> nn.Module:
        return self._modules[str(index)]

    def indices(self) -> list[int]:
        """The global layer index of each block, in order."""
        return [int(name) for name in self._modules]


def _check_layer_indices(layers: Sequence[int], num_layers: int) -> list[int]:
    layers = list(layers)
    if not layers or any(not isinstance(i, int) or isinstance(i, bool) for i in layers):
        raise ValueError(
            f"tpcore: GPTModel: layers must be a non-empty list of layer indices, got {layers!r}"
        )
    if (
        layers != list(range(layers[0], layers[0] + len(layers)))
        or not 0 <= layers[0] <= layers[-1] < num_layers
    ):
        raise ValueError(
            f"tpcore: GPTModel: layers {layers} are not consecutive indices in [0, {num_layers})"
        )
    return layers


class GPTModel(SharesProcessGroups, nn.Module):
    """Tensor-parallel GPT; the same function as `ReferenceGPT` for every TP size.

    `GPTModel(config)` takes one seed from the default generator (seed every rank alike)
    and draws only this rank's shards, on `device`, with the numbers `ReferenceGPT(config)`
    draws for the same indices (`models/initialization.py`): no rank builds the full
    model. `forward(ids [b, s])` returns this rank's logits shard `[b, s, vocab_padded/tp]`;
    with `target [b, s]` the loss (mean over non-ignored tokens, or `[b, s]` with
    `reduction="none"`).

    A pipeline stage holds only some of it: `layers` (consecutive global indices, default
    all), the embedding when `pre_process` (else `forward` takes the previous stage's
    hidden states `[s(/tp), b, h]`), the final norm, LM head and loss when `post_process`
    (else `forward` returns hidden states). Parameter names are the full model's.

    With `config.num_experts`, the MoE layers' experts split over `expert_group` (default:
    `parallel_state`'s expert-parallel group when groups are initialized, else none: every
    expert on every rank); see `tpcore.moe.MoELayer`.

    With `context_group` (default: `parallel_state`'s context-parallel group when groups are
    initialized, else none) of `cp` ranks, `ids` and `target` are this rank's `[b, s/cp]`
    of each sequence (`tpcore.context_parallel.slice_sequence`), logits and per-token
    losses likewise; the mean loss is over the whole sequences of the group (the same
    value on every CP rank), and each rank's gradients are its share: summed over CP
    (the data-and-context group does it) they are CP 1's.
    """

    def __init__(
        self,
        config: GPTConfig,
        *,
        group: dist.ProcessGroup | None = None,
        expert_group: dist.ProcessGroup | None = None,
        context_group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        device=None,
        _init: bool = True,
        layers: Sequence[int] | None = None,
        pre_process: bool = True,
        post_process: bool = True,
    ) -> None:
        super().__init__()
        self.config, self.group = config, resolve_tensor_group(group)
        self.tp_size, self.tp_rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        config.check_tp(self.tp_size)
        if expert_group is None and config.num_experts is not None and is_initialized():
            expert_group = get_expert_model_parallel_group()
        self.expert_group = expert_group
        config.check_ep(1 if expert_group is None else dist.get_world_size(expert_group))
        if context_group is None and is_initialized():
            context_group = get_context_parallel_group()
        if context_group is not None and dist.get_world_size(context_group) == 1:
            context_group = None
        self.context_group = context_group
        self.cp_size = 1 if context_group is None else dist.get_world_size(context_group)
        self.cp_rank = 0 if context_group is None else dist.get_rank(context_group)
        config.check_cp(self.cp_size, self.tp_size)
        # MoE balancing losses count a micro-batch's tokens over TP x CP
        token_group = None
        if self.cp_size > 1 and config.num_experts is not None:
            token_group = get_tensor_context_parallel_group() if is_initialized() else None
            if token_group is None and (config.moe_aux_loss_coeff or config.moe_z_loss_coeff):
                raise ValueError(
                    "tpcore: GPTModel: MoE balancing / z losses under context parallelism "
                    "count tokens over the tensor- and context-parallel ranks: create the "
                    "groups with initialize_model_parallel(context_parallel_size=...)"
                )
        layers = (
            range(config.num_layers)
            if layers is None
            else _check_layer_indices(layers, config.num_layers)
        )
        self.pre_process, self.post_process = pre_process, post_process
        if pre_process:
            self.embedding = ParallelEmbedding(config, self.group, dtype)
        elif post_process and config.tie_embeddings:
            self.embedding = _TiedHeadWeight(config, self.group, dtype)
        self.layers = LayerStack(
            {
                i: ParallelBlock(
                    config, self.group, dtype, i, expert_group, context_group, token_group
                )
                for i in layers
            }
        )
        if post_process:
            self.final_norm = make_norm(config, dtype, "meta")
            if config.sequence_parallel:
                _mark_sequence_parallel(*self.final_norm.parameters())
        if post_process and not config.tie_embeddings:
            rows = (
                pad_vocab_size(config.vocab_size, self.tp_size, config.make_vocab_size_divisible_by)
                // self.tp_size
            )
            self.lm_head = nn.Module()
            self.lm_head.weight = nn.Parameter(
                torch.empty(rows, config.hidden_size, dtype=dtype, device="meta")
            )
        attach_gpt_shard_specs(self, config, self.group, expert_group)
        to_empty_keeping_attributes(self, device or "cpu")
        reset_expert_biases(self)
        if _init and next(self.parameters()).device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self, seed: int | None = None) -> None:
        """Draw this rank's shards from `seed` (default: one draw of the default generator)."""
        seed = draw_seed() if seed is None else seed
        initialize_gpt_parameters(
            self, self.config, seed=seed, tensor_parallel=(self.tp_rank, self.tp_size)
        )

    @classmethod
    def from_dense(
        cls, dense: ReferenceGPT, *, group: dist.ProcessGroup | None = None
    ) -> "GPTModel":
        """This rank's shards of `dense` (same config, dtype and device)."""
        p = next(dense.parameters())
        model = cls(dense.config, group=group, dtype=p.dtype, device=p.device, _init=False)
        model.load_dense_state_dict(dense.state_dict())
        return model

    def load_dense_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load the shards of a `ReferenceGPT` state dict (full tensors, same names)."""
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name not in state:
                    raise KeyError(
                        f"tpcore: GPTModel.load_dense_state_dict: {name!r} "
                        "missing from the dense state dict"
                    )
                if tuple(state[name].shape) != param.shard_spec.global_shape:
                    raise ValueError(
                        f"tpcore: GPTModel: {name} has shape {list(state[name].shape)} in the "
                        f"dense state dict, expected {list(param.shard_spec.global_shape)}"
                    )
                piece = shard(state[name], param.shard_spec)
                if piece.shape != param.shape:
                    raise ValueError(
                        f"tpcore: GPTModel: {name} shard has "
                        f"shape {list(piece.shape)}, expected {list(param.shape)}"
                    )
                param.copy_(piece)
            for name, buffer in self.named_buffers():  # replicated (balancing biases)
                if name in state:
                    buffer.copy_(state[name])

    def to_dense(self) -> ReferenceGPT:
        """The full `ReferenceGPT` (a collective: call on every TP rank). LoRA adapters not
        merged yet are added into its weights, so it computes what this model computes."""
        if not (
            self.pre_process and self.post_process and len(self.layers) == self.config.num_layers
        ):
            raise ValueError(
                "tpcore: GPTModel.to_dense: this is one pipeline stage, not the whole model"
            )
        p = next(self.parameters())
        dense = to_empty(ReferenceGPT(self.config, dtype=p.dtype, device="meta"), p.device)
        adapters = lora_adapters(self)
        skip = {f"{name}.lora.{half}" for name in adapters for half in "AB"}
        state = {
            name: unshard(param.detach(), param.shard_spec)
            for name, param in self.named_parameters()
            if name not in skip
        }
        state.update(dict(self.named_buffers()))  # replicated (balancing biases)
        with torch.no_grad():
            for name, adapter in adapters.items():
                if not adapter.merged:
                    weight = self.get_submodule(name).weight
                    delta = unshard(adapter.weight_delta(), weight.shard_spec).to(weight.dtype)
                    state[f"{name}.weight"] = state[f"{name}.weight"] + delta
        dense.load_state_dict(state)
        return dense

    def decode(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Inference with a KV cache: `ids [b, s]` are the tokens after the `cache.length`
        ones already seen (all of the prompt at first, then one per step). Appends their
        keys and values to `cache` and returns this rank's logits of the last one
        `[b, vocab_padded/tp]`. A collective over the TP group. The whole model only (not
        a pipeline stage), without sequence parallelism (its layers expect sequence shards).
        Under context parallelism every CP rank decodes the whole sequence itself."""
        c = self.config
        if not (self.pre_process and self.post_process and len(self.layers) == c.num_layers):
            raise ValueError("tpcore: GPTModel.decode: this is one pipeline stage, not the model")
        if c.sequence_parallel:
            raise ValueError("tpcore: GPTModel.decode: not with sequence_parallel")
        start, s = cache.length, ids.shape[1]
        if start + s > cache.max_length:  # checked here, before any collective
            raise ValueError(
                f"tpcore: GPTModel.decode: {start} cached + {s} new tokens exceed its "
                f"{cache.max_length}"
            )
        if start + s > c.max_position_embeddings:
            raise ValueError(
                f"tpcore: GPTModel.decode: {start} cached + {s} new tokens exceed "
                f"max_position_embeddings {c.max_position_embeddings}"
            )
        x = self.embedding(ids, start)
        rope = None
        if c.position_embedding == "rotary":
            cos, sin = rotary_tables(
                start + s, c.head_dim, c.rotary_base, x.device, x.dtype, c.rotary_scaling
            )
            rope = cos[start:], sin[start:]
        for index, layer in enumerate(self.layers):  # (any key per layer names its cache)
            x = layer(x, rope, (cache, index))
        cache.advance(s)
        x = self.final_norm(x[-1:])
        logits = _op_entry.column_parallel_linear(
            x, self.head_weight(), None, live_group_name(self.group), False, False
        )
        return logits[0]

    def head_weight(self) -> torch.Tensor:
        return self.embedding.word.weight if self.config.tie_embeddings else self.lm_head.weight

    def moe_layers(self) -> dict[int, MoELayer]:
        """This stage's MoE layers by global layer index."""
        return {
            index: block.mlp
            for index, block in zip(self.layers.indices(), self.layers)
            if isinstance(block.mlp, MoELayer)
        }

    def take_moe_totals(self) -> dict[int, dict[str, torch.Tensor]]:
        """Each MoE layer's routing totals since the last call, by global layer index
        (`MoELayer.take_routing_totals`)."""
        return {index: layer.take_routing_totals() for index, layer in self.moe_layers().items()}

    def set_moe_aux_loss_scale(self, scale: float) -> None:
        """The gradient the MoE layers' balancing and z losses get in backward: the factor
        the language-model loss's gradient carries (1 / micro-batches when each micro-batch's
        loss is divided by their number; times the loss scale under fp16)."""
        for layer in self.moe_layers().values():
            layer.aux_loss_scale = scale

    def forward(
        self,
        ids: torch.Tensor,
        target: torch.Tensor | None = None,
        *,
        ignore_index: int = -100,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """`ids` `[b, s]`, or on a stage without the embedding the hidden states
        `[s(/tp), b, h]`."""
        c = self.config
        if self.pre_process and ids.dim() != 2:
            raise ValueError(
                f"tpcore: GPTModel: ids must be [batch, seq], got shape {list(ids.shape)}"
            )
        if not self.pre_process and ids.dim() != 3:
            raise ValueError(
                "tpcore: GPTModel: this pipeline stage takes hidden "
                f"states [seq, batch, hidden], got shape {list(ids.shape)}"
            )
        batch, local = (
            (ids.shape[0], ids.shape[1])
            if self.pre_process
            else (ids.shape[1], ids.shape[0] * (self.tp_size if c.sequence_parallel else 1))
        )
        seq = local * self.cp_size  # the whole sequence, over the context-parallel ranks
        if self.cp_size > 1:
            check_sequence(seq, self.cp_size)
        if seq > c.max_position_embeddings:
            raise ValueError(
                f"tpcore: GPTModel: sequence length {seq} exceeds "
                f"max_position_embeddings {c.max_position_embeddings}"
            )
        if c.sliding_window is not None and seq > c.sliding_window:
            raise ValueError(
                f"tpcore: GPTModel: sequence length {seq} exceeds "
                f"sliding_window {c.sliding_window} (sliding-window attention is not implemented)"
            )
        if target is not None and tuple(target.shape) != (batch, local):
            raise ValueError(
                f"tpcore: GPTModel: target shape {list(target.shape)} "
                f"does not match the input's [batch, seq] = {[batch, local]}"
            )
        if target is not None and not self.post_process:
            raise ValueError(
                "tpcore: GPTModel: this pipeline stage has no "
                "LM head; pass the target to the last stage"
            )
        device = ids.device
        where = (  # this rank's positions: its two chunks of each sequence
            context_positions(seq, self.cp_size, self.cp_rank, device) if self.cp_size > 1 else None
        )
        x = self.embedding(ids, positions=where) if self.pre_process else ids
        rope = None
        if c.position_embedding == "rotary":
            rope = rotary_tables(
                seq, c.head_dim, c.rotary_base, x.device, x.dtype, c.rotary_scaling
            )
            if where is not None:
                rope = tuple(t.index_select(0, where) for t in rope)
        if self.training and c.recompute != "none" and (c.dropout > 0 or c.attention_dropout > 0):
            _create_dropout_counters(x.device)
        for layer in self.layers:
            # Full recompute keeps only each block's input.
            x = (
                checkpoint(partial(layer, rope=rope), x)
                if c.recompute == "full"
                else layer(x, rope)
            )
        if not self.post_process:
            return x
        x = self.final_norm(x)
        weight = self.head_weight()
        if target is None or not c.fused_lm_head_loss:
            # f (or the sequence all-gather) then the vocab-sharded GEMM: [s, b, V/tp].
            logits = _op_entry.column_parallel_linear(
                x, weight, None, live_group_name(self.group), False, c.sequence_parallel
            )
            if target is None:
                return logits.transpose(0, 1)
            # The logits never leave forward: the loss may write its gradient into them.
            loss = vocab_parallel_cross_entropy(
                logits,
                target.t(),
                self.group,
                vocab_size=c.vocab_size,
                ignore_index=ignore_index,
                reduction=self._local_reduction(reduction),
                inplace_backward=True,
            )
        else:
            if c.sequence_parallel:
                # The fused loss sums the hidden gradient over TP itself: the gather's
                # backward must only keep this rank's chunk, not reduce-scatter again.
                x = gather_from_sequence_parallel(x, self.group, reduce_scatter_grad=False)
            loss = vocab_parallel_linear_cross_entropy(
                x,
                weight,
                target.t(),
                self.group,
                vocab_size=c.vocab_size,
                ignore_index=ignore_index,
                reduction=self._local_reduction(reduction),
            )
        if reduction == "none":
            return loss.t()
        if self.cp_size > 1:  # the group's sum (and count): g over CP, identity backward
            counted = (target != ignore_index).sum().to(loss.dtype)
            both = reduce_from_tensor_parallel(torch.stack([loss, counted]), self.context_group)
            loss = both[0] / both[1].detach() if reduction == "mean" else both[0]
        return loss

    def _local_reduction(self, reduction: str) -> str:
        """Under CP a mean is taken over the group's tokens: each rank sums its own."""
        return "sum" if self.cp_size > 1 and reduction == "mean" else reduction


def attach_gpt_shard_specs(
    module: nn.Module,
    config: GPTConfig,
    group: dist.ProcessGroup,
    expert_group: dist.ProcessGroup | None = None,
) -> None:
    """Give every parameter of `module` (a GPTModel, or modules of one under GPTModel's names:
    `layers.i.…`) its spec from `gpt_shard_spec`, placed on this rank of `group` (expert
    weights: of `expert_group`, None meaning one rank): the layers' own specs call the fused
    QKV and fc1 one part each. Parameters marked `sequence_parallel` get `partial_grad`."""
    # The dense layers split alike, and so do the MoE layers: one of each serves them all.
    kinds = sorted({config.is_moe_layer(i) for i in range(config.num_layers)})
    freq = [int(k) for k in kinds] if config.num_experts is not None else 1
    specs = gpt_shard_specs(dataclasses.replace(config, num_layers=len(kinds), moe_layer_freq=freq))
    placements = {
        "tensor": (dist.get_world_size(group), dist.get_rank(group), group),
        "expert": (1, 0, None)
        if expert_group is None
        else (dist.get_world_size(expert_group), dist.get_rank(expert_group), expert_group),
    }
    for name, p in module.named_parameters():
        match = re.match(r"^layers\.(\d+)\.", name)
        if match:
            kind = kinds.index(config.is_moe_layer(int(match.group(1))))
            name = f"layers.{kind}." + name[match.end() :]
        spec = specs[name]
        spec = spec.at(*placements[spec.axis])
        set_shard_spec(
            p, dataclasses.replace(spec, partial_grad=getattr(p, "sequence_parallel", False))
        )


def finalize_sequence_parallel_grads(
    model: nn.Module, group: dist.ProcessGroup | None = None
) -> None:
    """Sum over TP the gradients of parameters whose shard spec says `partial_grad` (norms
    and positions under sequence parallelism, LoRA adapters' replicated halves; the row
    layers' biases are summed by the layers themselves): each rank saw only its share.
    Call after backward, before the step (`sum_partial_grads`)."""
    sum_partial_grads(model, group)
