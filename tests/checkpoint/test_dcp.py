"""torch's distributed checkpoint (DCP) through the shard specs: a user's model of tpcore
layers (not GPTModel) with torch's AdamW, and GPTModel (one KV head: copies at TP 2 and 4)
with tpcore's ParallelAdamW, saved at TP 2 x DP 2 and loaded at TP 1 and 4. The loaded
weights and moments are compared with the saved ones gathered by plain all-gathers; one
more step after loading matches the step the saving run made; `dcp_to_torch_save` gives
the dense model's state dict."""

from __future__ import annotations

import contextlib
import os
import types

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

import tpcore
from checks import GQA_VARIANTS, assert_close, gpt_rule, merge_pieces, setup_tp, slice_piece
from tpcore import parallel_state
from tpcore.models import GPTModel

VOCAB, HIDDEN, FFN = 50, 16, 24
GPT_CONFIG = GQA_VARIANTS["llama_kv1"]


class UserModel(nn.Module):
    """A user's own model from tpcore layers: embedding, MLP, a norm, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = tpcore.VocabParallelEmbedding(VOCAB, HIDDEN, make_vocab_size_divisible_by=4)
        self.up = tpcore.ColumnParallelLinear(HIDDEN, FFN)
        self.down = tpcore.RowParallelLinear(FFN, HIDDEN, input_is_parallel=True)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = tpcore.ColumnParallelLinear(HIDDEN, 12, gather_output=True, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.head(self.norm(x + self.down(F.gelu(self.up(x)))))


def _user_loss(model: UserModel, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids, target = (
        torch.randint(0, VOCAB, (4, 6), generator=g),
        torch.randint(0, 12, (4, 6), generator=g),
    )
    return F.cross_entropy(model(ids).flatten(0, 1), target.flatten())


def _gather(t: torch.Tensor, dim: int | None, rows: int | None = None) -> torch.Tensor:
    """The dense tensor of a simple split by a plain all-gather (the reference)."""
    if dim is None:
        return t.detach().clone()
    group = parallel_state.get_tensor_model_parallel_group()
    pieces = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, t.detach().contiguous(), group=group)
    full = torch.cat(pieces, dim)
    return full[:rows] if rows is not None else full


_USER_SPLIT = {
    "embed.weight": (0, VOCAB),
    "up.weight": (0, None),
    "up.bias": (0, None),
    "down.weight": (1, None),
    "head.weight": (0, None),
}


def _user_dense(model: UserModel, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        dim, rows = _USER_SPLIT.get(name, (None, None))
        out[name] = _gather(p, dim, rows)
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}/{key}"] = _gather(opt.state[p][key], dim, rows)
    return out


def _gpt_dense(model: GPTModel, opt) -> dict[str, torch.Tensor]:
    group = parallel_state.get_tensor_model_parallel_group()
    tp = dist.get_world_size(group)

    def dense(name: str, t: torch.Tensor) -> torch.Tensor:
        pieces = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(pieces, t.detach().contiguous(), group=group)
        return merge_pieces(pieces, gpt_rule(name, GPT_CONFIG), GPT_CONFIG)

    out = {name: dense(name, p) for name, p in model.named_parameters()}
    for name, entry in opt.state_dict()["params"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}/{key}"] = dense(name, entry[key])
    return out


def _make_gpt(seed: int):
    from train_checks import make_adamw

    torch.manual_seed(seed)
    model = GPTModel(GPT_CONFIG)
    return model, make_adamw(model, GPT_CONFIG)


def _gpt_step(model, opt, seed: int) -> torch.Tensor:
    from train_checks import CLIP, train_batch

    ids, target = train_batch(seed, GPT_CONFIG)
    loss = model(ids, target)
    loss.backward()
    opt.step(1e-2, CLIP)
    return loss.detach()


@contextlib.contextmanager
def _presented_as(checkpointable: bool):
    """Present shards as CheckpointableTensors (torch 2.15+), or as ShardedTensors (older
    torch), for one job: the pool's ranks run later jobs with the default again."""
    import tpcore.checkpoint.dcp

    if checkpointable and not tpcore.checkpoint.dcp.has_checkpointable():
        pytest.skip("this torch's DCP has no CheckpointableTensor")
    tpcore.checkpoint.dcp.USE_CHECKPOINTABLE = checkpointable
    try:
        yield
    finally:
        tpcore.checkpoint.dcp.USE_CHECKPOINTABLE = None


def _save(rank, world, root, checkpointable=True):
    with _presented_as(checkpointable):
        _save_as_presented(rank, world, root)


def _save_as_presented(rank, world, root):
    setup_tp(2, replicas=True)
    torch.manual_seed(0)
    user = UserModel()
    user_opt = torch.optim.AdamW(user.parameters(), lr=1e-2)
    gpt, gpt_opt = _make_gpt(0)
    for step in range(2):
        _user_loss(user, step).backward()
        user_opt.step()
        user_opt.zero_grad()
        _gpt_step(gpt, gpt_opt, step)
    state = {
        "user": tpcore.sharded_state_dict(user),
        "user_optim": tpcore.sharded_optimizer_state_dict(user, user_opt),
        "gpt": tpcore.sharded_state_dict(gpt),
        "gpt_optim": tpcore.sharded_optimizer_state_dict(gpt, gpt_opt),
    }
    dcp.save(state, checkpoint_id=os.path.join(root, "dcp"))
    saved = {
        "user": _user_dense(user, user_opt),
        "gpt": _gpt_dense(gpt, gpt_opt),
        "dense_gpt": gpt.to_dense().state_dict(),
    }
    # One more step each, for the loading runs to repeat.
    saved["user_loss"] = _user_loss(user, 9).detach()
    _user_loss(user, 9).backward()
    user_opt.step()
    saved["gpt_loss"] = _gpt_step(gpt, gpt_opt, 9)
    saved["user_after"], saved["gpt_after"] = _user_dense(user, user_opt), _gpt_dense(gpt, gpt_opt)
    if rank == 0:
        torch.save(saved, os.path.join(root, "saved.pt"))
    dist.barrier()


@pytest.fixture(scope="module")
def tp2_dcp(cpu_ranks, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp"))
    cpu_ranks.run(_save, root)
    return root


def _load(rank, world, root, tp, checkpointable=True):
    with _presented_as(checkpointable):
        _load_as_presented(rank, world, root, tp)


def _load_as_presented(rank, world, root, tp):
    setup_tp(tp, replicas=True)
    saved = torch.load(os.path.join(root, "saved.pt"), weights_only=True)
    torch.manual_seed(1)  # other weights than the saved ones
    user = UserModel()
    user_opt = torch.optim.AdamW(
        user.parameters(), lr=1e-3, weight_decay=0.5
    )  # the checkpoint's hyperparameters win
    gpt, gpt_opt = _make_gpt(1)
    state = {
        "user": tpcore.sharded_state_dict(user),
        "user_optim": tpcore.sharded_optimizer_state_dict(user, user_opt),
        "gpt": tpcore.sharded_state_dict(gpt),
        "gpt_optim": tpcore.sharded_optimizer_state_dict(gpt, gpt_opt),
    }
    dcp.load(state, checkpoint_id=os.path.join(root, "dcp"))
    tpcore.load_sharded_state_dict(user, state["user"])
    tpcore.load_sharded_optimizer_state_dict(user, user_opt, state["user_optim"])
    tpcore.load_sharded_state_dict(gpt, state["gpt"])
    tpcore.load_sharded_optimizer_state_dict(gpt, gpt_opt, state["gpt_optim"])
    assert (
        user_opt.param_groups[0]["lr"] == 1e-2 and user_opt.param_groups[0]["weight_decay"] == 0.01
    )
    for what, got, want in (
        ("user", _user_dense(user, user_opt), saved["user"]),
        ("gpt", _gpt_dense(gpt, gpt_opt), saved["gpt"]),
    ):
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), f"TP {tp} {what}: {name}"
    tp_rank = dist.get_rank(parallel_state.get_tensor_model_parallel_group())
    for name, p in gpt.named_parameters():  # every rank's piece, copies of the KV head included
        assert torch.equal(
            p.detach(),
            slice_piece(
                saved["dense_gpt"][name], gpt_rule(name, GPT_CONFIG), tp_rank, tp, GPT_CONFIG
            ),
        ), name
    assert_close(
        _user_loss(user, 9).detach(), saved["user_loss"], f"TP {tp}: user loss after loading"
    )
    _user_loss(user, 9).backward()
    user_opt.step()
    assert_close(_gpt_step(gpt, gpt_opt, 9), saved["gpt_loss"], f"TP {tp}: GPT loss after loading")
    for what, got, want in (
        ("user", _user_dense(user, user_opt), saved["user_after"]),
        ("gpt", _gpt_dense(gpt, gpt_opt), saved["gpt_after"]),
    ):
        for name in want:
            assert_close(got[name], want[name], f"TP {tp} {what}: {name} after a step")


@pytest.mark.parametrize(
    "tp, checkpointable",
    [(1, True), (4, True), (4, False)],
    ids=["tp1", "tp4", "tp4-sharded-tensor"],
)
def test_dcp_saved_at_tp2_loads_at_other_sizes(cpu_ranks, tp2_dcp, tp, checkpointable):
    cpu_ranks.run(_load, tp2_dcp, tp, checkpointable)


def test_dcp_saved_as_sharded_tensors_loads_at_tp4(cpu_ranks, tmp_path):
    """The ShardedTensor form (torch before 2.15) writes the same checkpoint."""
    cpu_ranks.run(_save, str(tmp_path), False)
    cpu_ranks.run(_load, str(tmp_path), 4, True)


def test_dcp_to_torch_save_gives_the_dense_state_dict(tp2_dcp):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(tp2_dcp, "dense.pt")
    dcp_to_torch_save(os.path.join(tp2_dcp, "dcp"), out)
    dense = torch.load(out, weights_only=False)
    saved = torch.load(os.path.join(tp2_dcp, "saved.pt"), weights_only=True)
    assert dense["gpt"].keys() == saved["dense_gpt"].keys()
    for name, want in saved["dense_gpt"].items():
        assert torch.equal(dense["gpt"][name], want), name
    for name, want in saved["user"].items():
        got = (
            dense["user"][name]
            if "/" not in name
            else dense["user_optim"]["state"][name.split("/")[0]][name.split("/")[1]]
        )
        assert torch.equal(got, want), name


def _unsupported_optimizers_refused(rank, world):
    from checks import expect_error
    from tpcore.optimizer import DataParallelOptions, make_optimizer

    setup_tp(2, replicas=True)
    model, _ = _make_gpt(0)
    options = DataParallelOptions(contiguous_buffers=True, use_distributed_optimizer=True)
    group = parallel_state.get_tensor_model_parallel_group()
    opt, _ = make_optimizer(
        [model],
        options,
        tp_group=group,
        dp_group=parallel_state.get_data_parallel_group(),
        pp_group=None,
        lr=1e-3,
        weight_decay=0.0,
        betas=(0.9, 0.95),
        eps=1e-8,
        loss_scaler=None,
    )
    expect_error(
        NotImplementedError,
        "not a SimpleNamespace",
        tpcore.sharded_optimizer_state_dict,
        model,
        types.SimpleNamespace(state={}),
    )
    # DistributedAdamW's slices need DCP's CheckpointableTensor (torch 2.15+).
    import tpcore.checkpoint.dcp_slices as slices

    real, slices.has_checkpointable = slices.has_checkpointable, lambda: False
    try:
        expect_error(
            NotImplementedError, "needs torch 2.15", tpcore.sharded_optimizer_state_dict, model, opt
        )
    finally:
        slices.has_checkpointable = real


def test_unsupported_optimizers_are_refused_by_name(cpu_ranks):
    """A clear error, not an AttributeError: an object that is no known optimizer, and the
    distributed optimizer on a torch without CheckpointableTensor."""
    cpu_ranks.run(_unsupported_optimizers_refused)
