"""Pipelined GPT vs the unpipelined dense ReferenceGPT on the same batch: the loss and
every parameter's gradient, for PP 2 and 4, each schedule, several micro-batch counts,
TP 1 and 2 with and without sequence parallelism, and DP; tied embeddings through
several AdamW steps. One job per rank layout runs many cases (spawning ranks is slow)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import tpcore
from checks import GPT_VARIANTS as VARIANTS
from checks import GQA_VARIANTS, assert_close, gpt_rule, slice_piece
from tpcore import parallel_state
from tpcore.models import ReferenceGPT
from tpcore.optimizer.parallel_adamw import average_data_parallel_grads
from tpcore.pipeline_parallel import (
    PipelineStats,
    activation_shape,
    build_gpt_stages,
    duplicate_parameter_names,
    finalize_model_grads,
    forward_backward,
    gpt_forward_step,
    sync_tied_embeddings,
    tied_embedding_copies,
)
from tpcore.train import ParallelAdamW

MICRO, SEQ = 2, 8


def _config(variant: str, num_layers: int, **changes):
    return dataclasses.replace(
        {**VARIANTS, **GQA_VARIANTS}[variant], num_layers=num_layers, **changes
    )


def _stages_from(dense: ReferenceGPT, v: int, layers_per_stage=None):
    """This rank's chunks holding exactly the dense model's pieces (initialisation aside)."""
    chunks = build_gpt_stages(
        dense.config, num_model_chunks=v, layers_per_stage=layers_per_stage, _init=False
    )
    for chunk in chunks:
        chunk.load_dense_state_dict(dense.state_dict())
    return chunks


def _batches(config, m: int, dp: int, seed: int):
    """m micro-batches per DP rank, for all DP ranks: [dp][m] of (ids, target)."""
    g = torch.Generator().manual_seed(seed)
    make = lambda: torch.randint(0, config.vocab_size, (MICRO, SEQ), generator=g)  # noqa: E731
    return [[(make(), make()) for _ in range(m)] for _ in range(dp)]


def _local_dense_grad(name: str, dense_grad: torch.Tensor, config) -> torch.Tensor:
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    return slice_piece(dense_grad, gpt_rule(name, config), rank, tp, config)


def _check_case(
    config, dense, schedule: str, m: int, v: int, forward_only: bool = False, layers_per_stage=None
) -> set[str]:
    """One global batch through the pipeline; asserts loss and grads; returns the names checked."""
    dp_group, tp_group = (
        parallel_state.get_data_parallel_group(),
        parallel_state.get_tensor_model_parallel_group(),
    )
    dp, dp_rank, tp = (
        dist.get_world_size(dp_group),
        dist.get_rank(dp_group),
        dist.get_world_size(tp_group),
    )
    what = f"{schedule} m={m} v={v}{' forward-only' if forward_only else ''}"
    chunks = _stages_from(dense, v, layers_per_stage)
    all_batches = _batches(config, m, dp, seed=m * 10 + v)
    stats = PipelineStats()
    loss = forward_backward(
        gpt_forward_step(chunks, all_batches[dp_rank]),
        num_micro_batches=m,
        tensor_shape=activation_shape(config, MICRO, SEQ, tp),
        dtype=torch.float32,
        schedule=schedule,
        num_model_chunks=v,
        forward_only=forward_only,
        stats=stats,
    )
    dist.all_reduce(loss, group=dp_group)
    loss /= dp
    ids = torch.cat([ids for rank in all_batches for ids, _ in rank])
    target = torch.cat([t for rank in all_batches for _, t in rank])
    dense.zero_grad(set_to_none=True)
    dense_loss = dense(ids, target)
    assert_close(loss.float(), dense_loss.detach(), f"{what}: loss")
    if forward_only:
        assert all(p.grad is None for c in chunks for p in c.parameters()), (
            f"{what}: forward-only made gradients"
        )
        return set()
    dense_loss.backward()
    finalize_model_grads(chunks)
    checked = set()
    for chunk in chunks:
        grads = [p.grad for p in chunk.parameters()]
        average_data_parallel_grads(grads, dp_group)
        for name, p in chunk.named_parameters():
            expected = _local_dense_grad(name, dict(dense.named_parameters())[name].grad, config)
            assert_close(p.grad, expected, f"{what}: grad of {name}")
            checked.add(name)
    pp_rank, p = (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )
    if pp_rank < p - 1 and not forward_only:
        assert stats.released_bytes > 0, f"{what}: no sent activation was released"
    return checked


def _equivalence(rank, world, tp, pp, sp, variant, cases, extra=None):
    tpcore.initialize_model_parallel(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    layers = pp * max(v for _, _, v in cases)
    config = _config(variant, layers, sequence_parallel=sp, **(extra or {}))
    torch.manual_seed(0)
    dense = ReferenceGPT(config)
    for schedule, m, v in cases:
        checked = _check_case(config, dense, schedule, m, v)
        everywhere = [None] * world
        dist.all_gather_object(everywhere, sorted(checked))
        names = set().union(*map(set, everywhere))
        assert names == {n for n, _ in dense.named_parameters()}, (
            f"{schedule} m={m}: unchecked {set(dict(dense.named_parameters())) - names}"
        )
    _check_case(config, dense, cases[0][0], cases[0][1], cases[0][2], forward_only=True)


PP4_CASES = (
    [("gpipe", m, 1) for m in (1, 3, 4, 8)]
    + [("1f1b", m, 1) for m in (1, 3, 4, 8)]
    + [("interleaved", m, 2) for m in (4, 8)]
)
PP2_CASES = [
    ("gpipe", 1, 1),
    ("gpipe", 3, 1),
    ("1f1b", 1, 1),
    ("1f1b", 3, 1),
    ("1f1b", 4, 1),
    ("interleaved", 2, 2),
    ("interleaved", 4, 2),
]


def test_pp4_every_schedule_matches_dense(cpu_ranks):
    cpu_ranks.run(_equivalence, 1, 4, False, "gpt2", PP4_CASES)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2+sp"])
def test_tp2_pp2_matches_dense(cpu_ranks, sp, variant):
    cpu_ranks.run(_equivalence, 2, 2, sp, variant, PP2_CASES)


def test_tp2_pp2_with_one_kv_head_copied_on_both_tp_ranks_matches_dense(cpu_ranks):
    cpu_ranks.run(_equivalence, 2, 2, True, "llama_kv1", [("1f1b", 3, 1), ("interleaved", 2, 2)])


def test_pp2_dp2_matches_dense(cpu_ranks):
    cpu_ranks.run(
        _equivalence, 1, 2, False, "llama", [("1f1b", 3, 1), ("gpipe", 2, 1), ("interleaved", 4, 2)]
    )


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_and_fused_loss_under_pp(cpu_ranks, recompute):
    # Full recompute makes each stage's output a checkpoint's output: releasing it after the
    # send must stay safe.
    cpu_ranks.run(
        _equivalence,
        1,
        4,
        False,
        "gpt2",
        [("1f1b", 4, 1), ("interleaved", 4, 2)],
        dict(recompute=recompute, fused_lm_head_loss=True),
    )


def _uneven_layers(rank, world):
    tpcore.initialize_model_parallel(pipeline_parallel_size=4)
    config = _config("gpt2", 7)
    torch.manual_seed(0)
    dense = ReferenceGPT(config)
    for layers in ([1, 3, 2, 1], [[0, 1], [2], [3, 4, 5], [6]], None):
        checked = _check_case(config, dense, "1f1b", 3, 1, layers_per_stage=layers)
        everywhere = [None] * world
        dist.all_gather_object(everywhere, sorted(checked))
        assert set().union(*map(set, everywhere)) == {n for n, _ in dense.named_parameters()}
    chunks = _stages_from(dense, 1, [1, 3, 2, 1])
    assert [int(k) for k in chunks[0].layers._modules] == [[0], [1, 2, 3], [4, 5], [6]][rank]


def test_explicit_and_uneven_layer_splits(cpu_ranks):
    cpu_ranks.run(_uneven_layers)


# ---------------------------------------------------------------------------------------
# Tied embeddings and the optimizer across stages
# ---------------------------------------------------------------------------------------

STEPS, LR, CLIP = 3, 1e-2, 0.05
# as in tests/train_checks.py: a tiny eps would turn fp32 rounding in tiny gradients into
# whole steps
EPS = 1e-3


def _dense_adamw(dense: ReferenceGPT) -> torch.optim.AdamW:
    decay = [p for p in dense.parameters() if p.dim() >= 2]
    no_decay = [p for p in dense.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        betas=(0.9, 0.95),
        eps=EPS,
    )


def _adamw_steps(rank, world, tp, pp, schedule, v):
    tpcore.initialize_model_parallel(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    state = parallel_state.get_parallel_state()
    config = _config("gpt2", pp * v)
    torch.manual_seed(0)
    dense = ReferenceGPT(config)
    chunks = _stages_from(dense, v)
    copies = tied_embedding_copies(chunks)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    assert len(copies) == (1 if pp_rank in (0, pp - 1) else 0)
    if copies:  # make the copies differ, then check that syncing makes them equal
        with torch.no_grad():
            copies[0].add_(float(pp_rank))
    sync_tied_embeddings(chunks)
    opt = ParallelAdamW(
        chunks,
        is_replicated=lambda n: gpt_rule(n, config)[0] == "replicated",
        tp_group=state.tensor_group,
        dp_group=state.data_group,
        pp_group=state.pipeline_group,
        duplicates=duplicate_parameter_names(chunks),
        lr=LR,
        weight_decay=0.1,
        eps=EPS,
    )
    dense_opt = _dense_adamw(dense)
    dp = dist.get_world_size(state.data_group)
    m = 4
    for step in range(STEPS):
        all_batches = _batches(config, m, dp, seed=100 + step)
        forward_backward(
            gpt_forward_step(chunks, all_batches[dist.get_rank(state.data_group)]),
            num_micro_batches=m,
            tensor_shape=activation_shape(config, MICRO, SEQ, tp),
            dtype=torch.float32,
            schedule=schedule,
            num_model_chunks=v,
        )
        finalize_model_grads(chunks)
        norm, skipped = opt.step(LR, CLIP)
        ids = torch.cat([i for r in all_batches for i, _ in r])
        target = torch.cat([t for r in all_batches for _, t in r])
        dense_opt.zero_grad()
        dense(ids, target).backward()
        dense_norm = torch.nn.utils.clip_grad_norm_(
            dense.parameters(), CLIP
        )  # same formula: clip / (norm + 1e-6)
        dense_opt.step()
        assert not skipped and norm > CLIP, "the test must exercise clipping"
        assert abs(norm - dense_norm.item()) <= 1e-5 * dense_norm.item(), (
            step,
            norm,
            dense_norm.item(),
        )
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            assert_close(
                p.detach(),
                _local_dense_grad(name, dict(dense.named_parameters())[name].detach(), config),
                f"after {STEPS} steps: {name}",
            )
    if copies and pp > 1:  # the two copies of the tied embedding are still bit for bit equal
        both = tpcore.comm.all_gather(copies[0].detach(), 0, state.embedding_group)
        first, last = both.chunk(2, 0)
        assert torch.equal(first, last), "tied embedding copies diverged"


@pytest.mark.parametrize(
    "tp,pp,schedule,v", [(1, 4, "1f1b", 1), (2, 2, "interleaved", 2), (1, 2, "gpipe", 1)]
)
def test_tied_embeddings_and_adamw_match_dense(cpu_ranks, tp, pp, schedule, v):
    cpu_ranks.run(_adamw_steps, tp, pp, schedule, v)
