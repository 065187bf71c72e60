"""GPTModel split into pipeline stages: which layers each stage holds, this rank's model
chunks, the activation shape between stages, and the word embedding tied across the
first and last stage.

Virtual stage `s = chunk * p + rank` of p * v holds consecutive layers; stage 0 also the
embedding, the last stage the final norm, the LM head and the loss. Parameter names are
the full model's (`layers.7.…`), so a stage's state dict is a subset of `ReferenceGPT`'s.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..models.config import GPTConfig
from ..models.gpt import GPTModel, finalize_sequence_parallel_grads
from ..parallel_state import get_parallel_state, resolve_tensor_group
from .p2p import resolve_pipeline_group

__all__ = [
    "split_layers",
    "build_gpt_stages",
    "activation_shape",
    "gpt_forward_step",
    "tied_embedding_copies",
    "duplicate_parameter_names",
    "sync_tied_embeddings",
    "finalize_model_grads",
]

TIED_WEIGHT = "embedding.word.weight"


def split_layers(
    num_layers: int,
    num_stages: int,
    layers_per_stage: Sequence[int] | Sequence[Sequence[int]] | None = None,
) -> list[list[int]]:
    """The global layer indices of each of `num_stages` (virtual) stages, in order.

    Default: an even split (when `num_layers` does not divide, the first stages get one
    layer more). `layers_per_stage` is either a count per stage or the indices per stage;
    either way every layer must be placed exactly once, in order, with at least one per
    stage, else a ValueError says what is wrong.
    """
    if num_layers < num_stages:
        raise ValueError(
            f"tpcore: pipeline: {num_layers} layers cannot fill {num_stages} stages (each needs at "
            "least one layer)"
        )
    if layers_per_stage is None:
        base, extra = divmod(num_layers, num_stages)
        layers_per_stage = [base + (s < extra) for s in range(num_stages)]
    spec = list(layers_per_stage)
    if len(spec) != num_stages:
        raise ValueError(
            f"tpcore: pipeline: the layer list has {len(spec)} entries for {num_stages} stages: "
            f"{spec}"
        )
    if all(isinstance(x, int) and not isinstance(x, bool) for x in spec):
        if any(n < 1 for n in spec) or sum(spec) != num_layers:
            raise ValueError(
                f"tpcore: pipeline: layers per stage {spec} must be >= 1 each and sum to "
                f"num_layers={num_layers} (they sum to {sum(spec)})"
            )
        bounds = [sum(spec[:s]) for s in range(num_stages + 1)]
        return [list(range(bounds[s], bounds[s + 1])) for s in range(num_stages)]
    stages = [list(x) for x in spec]
    flat = [i for stage in stages for i in stage]
    for s, stage in enumerate(stages):
        if not stage:
            raise ValueError(f"tpcore: pipeline: stage {s} has no layers: {stages}")
    for i in sorted(set(flat)):
        if flat.count(i) > 1:
            raise ValueError(
                f"tpcore: pipeline: layer {i} is placed {flat.count(i)} times: {stages}"
            )
    missing = sorted(set(range(num_layers)) - set(flat))
    if missing:
        raise ValueError(f"tpcore: pipeline: layers {missing} are placed on no stage: {stages}")
    if flat != list(range(num_layers)):
        raise ValueError(
            "tpcore: pipeline: stages must hold consecutive layers in order "
            f"(0..{num_layers - 1}), got {stages}"
        )
    return stages


def build_gpt_stages(
    config: GPTConfig,
    *,
    num_model_chunks: int = 1,
    layers_per_stage: Sequence[int] | Sequence[Sequence[int]] | None = None,
    tp_group: dist.ProcessGroup | None = None,
    pp_group: dist.ProcessGroup | None = None,
    dtype: torch.dtype | None = None,
    device=None,
    _init: bool = True,
) -> list[GPTModel]:
    """This rank's `num_model_chunks` model chunks (chunk c is virtual stage c * p + rank).

    Each chunk is initialised as `GPTModel(config)` would be from the default generator's
    current state, so the pipeline holds exactly the pieces of that model.
    """
    pp_group = resolve_pipeline_group(pp_group)
    p, rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
    stages = split_layers(config.num_layers, p * num_model_chunks, layers_per_stage)
    rng = torch.get_rng_state()
    chunks = []
    for chunk in range(num_model_chunks):
        torch.set_rng_state(rng)
        stage = chunk * p + rank
        chunks.append(
            GPTModel(
                config,
                group=tp_group,
                dtype=dtype,
                device=device,
                _init=_init,
                layers=stages[stage],
                pre_process=stage == 0,
                post_process=stage == len(stages) - 1,
            )
        )
    return chunks


def activation_shape(
    config: GPTConfig, micro_batch_size: int, seq_length: int, tp_size: int = 1
) -> list[int]:
    """What flows between stages: `[s, b, h]`, or `[s/tp, b, h]` with sequence parallelism."""
    if config.sequence_parallel and seq_length % tp_size:
        raise ValueError(
            f"tpcore: pipeline: sequence length {seq_length} is not divisible by the "
            f"tensor-parallel size {tp_size}"
        )
    return [
        seq_length // tp_size if config.sequence_parallel else seq_length,
        micro_batch_size,
        config.hidden_size,
    ]


def gpt_forward_step(
    chunks: Sequence[GPTModel],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    tensor_shape: Sequence[int] | None = None,
    autocast_dtype: torch.dtype | None = None,
):
    """The `forward_step` of `forward_backward` for GPT chunks and micro-batches
    `(ids [b, s], target [b, s])`: the first stage reads ids, the last the targets; the
    forward runs under torch.autocast to `autocast_dtype` when given (the backward,
    started by the schedule, outside it, as torch.autocast recommends).
    With `tensor_shape`, checks now, before any message and alike on every rank (all
    ranks pass the same batches), that every micro-batch makes activations of that shape."""
    if tensor_shape is not None:
        c, tp = chunks[0].config, chunks[0].tp_size
        for i, (ids, target) in enumerate(batches):
            if ids.dim() != 2 or tuple(target.shape) != tuple(ids.shape):
                raise ValueError(
                    f"tpcore: pipeline: micro-batch {i}: ids {list(ids.shape)} and target "
                    f"{list(target.shape)} must both be [batch, seq]"
                )
            made = activation_shape(c, ids.shape[0], ids.shape[1], tp)
            if made != list(tensor_shape):
                raise ValueError(
                    f"tpcore: pipeline: micro-batch {i} of [batch, seq] = {list(ids.shape)} makes "
                    f"activations {made}, but the pipeline sends {list(tensor_shape)}"
                )

    def step(chunk: int, micro: int, x: torch.Tensor | None) -> torch.Tensor:
        model, (ids, target) = chunks[chunk], batches[micro]
        with torch.autocast(
            ids.device.type,
            dtype=autocast_dtype or torch.bfloat16,
            enabled=autocast_dtype is not None,
        ):
            return model(ids if model.pre_process else x, target if model.post_process else None)

    return step


def _word_weights(
    chunks: Sequence[GPTModel], keep: Callable[[GPTModel], bool]
) -> list[nn.Parameter]:
    """`embedding.word.weight` of every chunk that has one and passes `keep`."""
    return [
        p
        for chunk in chunks
        if keep(chunk)
        for name, p in chunk.named_parameters()
        if name == TIED_WEIGHT
    ]


def tied_embedding_copies(chunks: Sequence[GPTModel]) -> list[nn.Parameter]:
    """The tied word-embedding weights on this rank (first and/or last stage chunk)."""
    return _word_weights(
        chunks, lambda c: c.config.tie_embeddings and (c.pre_process or c.post_process)
    )


def lookup_and_head_weights(chunks: Sequence[GPTModel]) -> list[nn.Parameter]:
    """The tied word-embedding weights this rank uses both for the lookup and as the LM head
    of one chunk (a chunk holding the first and the last stage: no pipeline parallelism)."""
    return _word_weights(
        chunks, lambda c: c.config.tie_embeddings and c.pre_process and c.post_process
    )


def lookup_only_weights(chunks: Sequence[GPTModel]) -> list[nn.Parameter]:
    """The word-embedding weights this rank uses only for the lookup: untied, or a first
    pipeline stage's tied copy. Their gradient is zero outside the looked-up rows."""
    return _word_weights(
        chunks, lambda c: c.pre_process and not (c.config.tie_embeddings and c.post_process)
    )


def head_only_tied_weights(chunks: Sequence[GPTModel]) -> list[nn.Parameter]:
    """The tied word-embedding copies this rank uses only as the LM head (a last pipeline
    stage's chunk without the embedding): their gradient is complete early in the backward."""
    return _word_weights(
        chunks, lambda c: c.config.tie_embeddings and c.post_process and not c.pre_process
    )


def duplicate_parameter_names(chunks: Sequence[GPTModel]) -> set[str]:
    """Names of this rank's parameters that copy one held by another stage: the last
    stage's tied embedding (its gradient equals the first stage's after
    `finalize_model_grads`, so a norm counts it once, on the first stage)."""
    if any(chunk.pre_process for chunk in chunks):
        return set()
    return {TIED_WEIGHT} if tied_embedding_copies(chunks) else set()


def _embedding_group(
    chunks: Sequence[GPTModel], group: dist.ProcessGroup | None
) -> dist.ProcessGroup | None:
    if not tied_embedding_copies(chunks):
        return None
    return group if group is not None else get_parallel_state().embedding_group


def sync_tied_embeddings(
    chunks: Sequence[GPTModel], group: dist.ProcessGroup | None = None
) -> None:
    """Copy the first stage's word embedding into the last stage's (a collective over the
    embedding group: call on the first and the last stage; others return at once)."""
    group = _embedding_group(chunks, group)
    if group is None or dist.get_world_size(group) == 1:
        return
    with torch.no_grad():
        for p in tied_embedding_copies(chunks):
            p.copy_(comm.broadcast(p.detach(), 0, group))


def finalize_model_grads(
    chunks: Sequence[GPTModel],
    *,
    tp_group: dist.ProcessGroup | None = None,
    embedding_group: dist.ProcessGroup | None = None,
) -> None:
    """After `forward_backward`, before the optimizer: sum over TP the gradients of
    sequence-parallel parameters, and over the embedding group (first + last stage) the
    gradients of the tied word embedding, so both copies take the same step."""
    tp_group = resolve_tensor_group(tp_group)
    for chunk in chunks:
        finalize_sequence_parallel_grads(chunk, tp_group)
    group = _embedding_group(chunks, embedding_group)
    if group is None or dist.get_world_size(group) == 1:
        return
    for p in tied_embedding_copies(chunks):
        if not p.requires_grad:  # frozen (fine-tuning adapters): both copies stay as they are
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.copy_(comm.all_reduce(p.grad, group))
