"""Gradients of replicated parameters that backward gives each rank only a share of, made
dense inside backward: KV heads copied because TP is larger than the KV head count, and
norms over each head (Qwen3's and Gemma 3's q / k norms).

During each forward of such a module, its parameters pass through an identity whose
backward sums the gradient over the ranks that share the parameter (`copy_to_tensor_parallel`
for the whole group, `tensor_parallel.shared_grads.sum_over_copies` for blocks of it, as
GPTModel does). The sum is made before the gradient is accumulated
into `.grad`, so gradient accumulation stays exact, and it follows whatever parameter the
module holds when it runs: freezing or unfreezing later, `load_state_dict(assign=True)`.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ...tensor_parallel.mappings import copy_to_tensor_parallel
from ...tensor_parallel.shared_grads import sum_over_copies

__all__ = ["install_gradient_sums", "sum_replicated_kv_grads", "hook_parameters"]

Through = Callable[[torch.Tensor], torch.Tensor]


def hook_parameters(
    module: nn.Module,
    through: Through,
    child: str | None = None,
    names: tuple[str, ...] | None = None,
) -> None:
    """Swap the parameters of `module` (or of its submodule `child`; only `names`, when
    given) for `through(parameter)` during each forward of `module`. The hooks find the
    module they run on, so a deep copy of the model swaps its own parameters."""
    held: list[tuple[nn.Module, dict[str, nn.Parameter]]] = []

    def before(mod: nn.Module, args) -> None:
        owner = mod if child is None else mod.get_submodule(child)
        grads = torch.is_grad_enabled()
        params = {
            n: p
            for n, p in owner._parameters.items()
            if p is not None and p.requires_grad and grads and (names is None or n in names)
        }
        held.append((owner, params))
        for n, p in params.items():
            owner._parameters[n] = through(p)

    def after(mod: nn.Module, args, output) -> None:
        if held:  # always_call: also when the forward raised
            owner, params = held.pop()
            owner._parameters.update(params)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after, always_call=True)


def install_gradient_sums(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Hook the replicated KV layers and head norms of `model.tpcore_plan` (see the module
    docstring)."""
    plan = model.tpcore_plan
    layout = plan.layout
    if layout.tp_size == 1:
        return
    for name in plan.head_norms:
        hook_parameters(model.get_submodule(name), lambda p: copy_to_tensor_parallel(p, group))
    if layout.kv_replicated:
        copies = layout.tp_size // layout.kv_heads  # adjacent ranks sharing one KV head
        for rep in plan.replacements:
            if rep.kv_replicated:
                hook_parameters(
                    model.get_submodule(rep.name),
                    lambda p, rows=rep.kv_rows: sum_over_copies(p, group, copies, rows),
                )


def sum_replicated_kv_grads(model: nn.Module) -> None:
    """Kept for code written for earlier tpcore releases, where the replicated KV heads' gradients
    were summed by this call after backward: backward sums them now (`install_gradient_sums`),
    so this checks that `model` was parallelized by tpcore.hf and does nothing else."""
    if getattr(model, "tpcore_plan", None) is None:
        raise ValueError(f"tpcore.hf: {type(model).__name__} was not parallelized by tpcore.hf")
