"""The mixture-of-experts layer that takes the MLP's place in a GPTModel block.

`MoELayer` maps `[s(/tp), b, h] -> [s(/tp), b, h]` like the dense MLP:
1. The tokens of one TP group are shared out over its ranks: under sequence parallelism
   each rank already holds its `s/tp`; otherwise each takes its `1/tp` of the flattened
   tokens here and the outputs are all-gathered at the end (Megatron requires sequence
   parallelism with TP; tpcore does not). So no two ranks route the same token.
2. The router (`[experts, h]`, replicated, computed in float32) picks each token's top-k
   experts (`router.route`); the balancing and z losses enter backward through
   `attach_aux_loss` (Megatron's MoEAuxLossAutoScaler): they need not be added to the
   language-model loss, which works the same across pipeline stages.
3. The dispatcher (`dispatch.all_to_all` or `.all_gather`) brings the routed tokens to the
   ranks of the expert-parallel group holding their experts (`experts / ep` each, expert
   tensor parallelism 1), where one grouped GEMM per projection runs them.
4. An optional shared expert (a TP-split MLP every token goes through, optionally gated by
   `sigmoid(x . w)`) is added.

Gradients: the router's and (at ep = 1) the experts' are each rank's share over its tokens,
summed over TP like the sequence-parallel norms' (`partial_grad`); at ep > 1 the experts'
are summed over the expert-data-parallel group instead (`parallel_state`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .._module_utils import SharesProcessGroups
from ..tensor_parallel.mappings import (
    gather_from_sequence_parallel,
    scatter_to_sequence_parallel,
)
from . import dispatch
from .grouped_gemm import grouped_linear
from .router import RouterConfig, route

__all__ = ["MoEConfig", "MoELayer", "ExpertWeights", "attach_aux_loss", "reset_expert_biases"]


@dataclass(frozen=True)
class MoEConfig:
    """The shape and behaviour of one MoE layer (GPTModel builds it from its GPTConfig)."""

    hidden_size: int
    """Model width H."""
    ffn_hidden_size: int
    """Inner width f of each expert."""
    routing: RouterConfig
    """Experts, top-k and the router's options."""
    activation: Callable[[torch.Tensor], torch.Tensor]
    """The experts' nonlinearity on fc1's output `[n, (2)f] -> [n, f]`."""
    gated: bool = False
    """fc1 holds [gate; up] rows, `2f` of them (SwiGLU, GeGLU)."""
    sequence_parallel: bool = False
    """The layer's input and output are sequence-parallel shards `[s/tp, b, h]`."""
    dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """How tokens reach their experts' ranks (`dispatch`)."""
    grouped_gemm: bool = True
    """One grouped GEMM per projection; False: a loop over the local experts."""
    shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(x . w), w `[1, H]` (Qwen2-MoE)."""
    expert_bias_update_rate: float | None = None
    """DeepSeek-V3's auxiliary-loss-free balancing (sigmoid scores only): a per-expert bias,
    added to the scores for choosing the experts, moves by this much after each step
    towards the mean load (`update_expert_bias`). None: no bias."""

    def __post_init__(self) -> None:
        rate = self.expert_bias_update_rate
        if rate is not None and not (rate > 0 and self.routing.score == "sigmoid"):
            raise ValueError(
                "tpcore: MoEConfig: expert_bias_update_rate must be > 0, with the sigmoid "
                f"score function (got {rate!r}, {self.routing.score})"
            )


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, loss, scale):  # type: ignore[override]
        ctx.scale = scale
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        shape, dtype, device = ctx.loss_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def attach_aux_loss(out: torch.Tensor, loss: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """`out` unchanged; backward through it also backpropagates `loss` with gradient `scale`
    (the factor the language-model loss's gradient carries, e.g. 1 / micro-batches)."""
    if not loss.requires_grad:
        return out
    return _AttachAuxLoss.apply(out, loss, scale)


def reset_expert_biases(module: nn.Module) -> None:
    """Zero every balancing bias (`router.expert_bias`) below `module`: after the module is
    moved off the meta device, where buffers are left uninitialised."""
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if name.endswith("router.expert_bias"):
                buffer.zero_()


def _recomputing() -> bool:
    """Whether this forward runs inside a backward pass (activation recomputation)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class _Weight(nn.Module):
    def __init__(self, shape: Sequence[int], dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, dtype=dtype, device="meta"))


class ExpertWeights(nn.Module):
    """This rank's experts: `fc1.weight [experts/ep, (2)f, h]` (gated: gate rows then up
    rows, as the dense MLP's fc1) and `fc2.weight [experts/ep, h, f]`."""

    def __init__(self, config: MoEConfig, local: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        c, f = config, config.ffn_hidden_size
        self.config = c
        self.fc1 = _Weight((local, f * (2 if c.gated else 1), c.hidden_size), dtype)
        self.fc2 = _Weight((local, c.hidden_size, f), dtype)

    def forward(self, rows: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """`rows [n, h]` sorted by local expert, `counts[e]` of expert e -> `[n, h]`."""
        act, fc1, fc2 = self.config.activation, self.fc1.weight, self.fc2.weight
        device = rows.device.type
        if torch.is_autocast_enabled(device):  # as autocast runs a matmul: in its dtype
            dtype = torch.get_autocast_dtype(device)
            rows, fc1, fc2 = rows.to(dtype), fc1.to(dtype), fc2.to(dtype)
        if self.config.grouped_gemm:
            return grouped_linear(act(grouped_linear(rows, fc1, counts)), fc2, counts)
        out = []
        for e, block in enumerate(rows.split(list(counts))):
            out.append(act(block @ fc1[e].t()) @ fc2[e].t())
        return torch.cat(out)


class MoELayer(SharesProcessGroups, nn.Module):
    """Routed experts and an optional shared expert: `[s(/tp), b, h] -> [s(/tp), b, h]`
    (module doc). `group`: the TP group; `expert_group`: the expert-parallel group (None:
    every expert on this rank); `shared_expert`: the TP-split MLP of the shared expert, or
    None; `token_group`: where one batch's tokens are spread beyond the TP group (context
    parallelism: the TP x CP group), so that the balancing and z losses count all of them
    (None: the TP group when tokens are shared out over it)."""

    def __init__(
        self,
        config: MoEConfig,
        *,
        group: dist.ProcessGroup,
        expert_group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        shared_expert: nn.Module | None = None,
        token_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        c = self.config = config
        self.group, self.expert_group, self.token_group = group, expert_group, token_group
        self.tp_size = dist.get_world_size(group)
        ep = 1 if expert_group is None else dist.get_world_size(expert_group)
        experts = c.routing.num_experts
        if experts % ep:
            raise ValueError(
                f"tpcore: MoELayer: {experts} experts do not split over the {ep} "
                "expert-parallel ranks"
            )
        self.router = _Weight((experts, c.hidden_size), dtype)
        if c.expert_bias_update_rate is not None:
            self.router.register_buffer("expert_bias", torch.zeros(experts, device="meta"))
        self.experts = ExpertWeights(config, experts // ep, dtype)
        if shared_expert is not None:
            self.shared_expert = shared_expert
            if c.shared_expert_gate:
                self.shared_expert_gate = _Weight((1, c.hidden_size), dtype)
        self.aux_loss_scale = 1.0
        """The gradient the balancing and z losses get in backward (module doc, step 2)."""
        self.last_routing: dict[str, torch.Tensor] = {}
        """The last forward's detached `aux_loss`, `z_loss` (this rank's shares) and
        `tokens_per_expert` `[experts]` (this rank's tokens), for logging."""
        self._totals: dict[str, torch.Tensor] = {}

    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """DeepSeek-V3's balancing step: each expert's bias moves by the update rate towards
        the mean load, `bias += rate * sign(mean - load)`, given the step's loads `[experts]`
        over the whole batch (the same on every rank, so the biases stay equal)."""
        rate = self.config.expert_bias_update_rate
        if rate is None:
            return
        loads = tokens_per_expert.float()
        with torch.no_grad():
            self.router.expert_bias += rate * torch.sign(loads.mean() - loads).to(
                self.router.expert_bias.device
            )

    def take_routing_totals(self) -> dict[str, torch.Tensor]:
        """`last_routing`'s values summed over the forwards since the last call (activation
        recomputation's second forward not counted), and reset: a step's totals for its
        metrics. Empty when no forward ran."""
        totals, self._totals = self._totals, {}
        return totals

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, tp = self.config, self.tp_size
        tokens = x.reshape(-1, x.shape[-1])
        split_here = tp > 1 and not c.sequence_parallel
        if split_here and tokens.shape[0] % tp:
            if torch.is_grad_enabled():
                raise ValueError(
                    f"tpcore: MoELayer: {tokens.shape[0]} tokens (sequence x batch) do not "
                    f"split over the {tp} tensor-parallel ranks; make sequence x batch "
                    "divisible, or use sequence parallelism"
                )
            # Without gradients (decoding one token at a time) every TP rank may route all of
            # them: each gets the same outputs, and nothing is summed over TP.
            split_here = False
        if split_here:
            tokens = scatter_to_sequence_parallel(tokens, self.group)
        with torch.autocast(tokens.device.type, enabled=False):  # the router in float32
            logits = F.linear(tokens.float(), self.router.weight.float())
        shared_tokens = tp > 1 and (split_here or c.sequence_parallel)
        routing = route(
            logits,
            c.routing,
            getattr(self.router, "expert_bias", None),
            token_group=self.token_group or (self.group if shared_tokens else None),
        )
        dispatcher = dispatch.all_gather if c.dispatcher == "allgather" else dispatch.all_to_all
        out = dispatcher(tokens, routing, self.experts, c.routing.num_experts, self.expert_group)
        out = attach_aux_loss(out, routing.aux_loss + routing.z_loss, self.aux_loss_scale)
        self.last_routing = {
            "aux_loss": routing.aux_loss.detach(),
            "z_loss": routing.z_loss.detach(),
            "tokens_per_expert": routing.tokens_per_expert.detach(),
        }
        if not _recomputing():
            for key, value in self.last_routing.items():
                self._totals[key] = self._totals.get(key, 0) + value
        if split_here:
            # The loss's gradient is the same on every TP rank here: keep this rank's rows.
            out = gather_from_sequence_parallel(out, self.group, reduce_scatter_grad=False)
        out = out.view(x.shape)
        if hasattr(self, "shared_expert"):
            shared = self.shared_expert(x)
            if c.shared_expert_gate:
                shared = shared * torch.sigmoid(F.linear(x, self.shared_expert_gate.weight))
            out = out + shared
        return out
