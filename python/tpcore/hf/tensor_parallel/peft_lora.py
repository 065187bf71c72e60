"""PEFT's LoRA on models split by tpcore.hf.

`parallelize(peft_model)` takes the LoRA layers PEFT wrapped around the model's linear layers
out (`take_adapters`: their A and B, rank, alpha, dropout), splits the plain model as usual,
and gives each resulting tpcore layer a `LoRAAdapter` holding its slices of A and B
(`attach_adapters`): the column layers' B split like their rows, the row layers' A like their
columns. A fused layer (Phi-3's qkv_proj, GPT-2's c_attn) keeps PEFT's one adapter over all
its parts. The model stays a `PeftModel`: its forward is PEFT's; `tpcore.hf.save_pretrained`
writes what PEFT's `PeftModel.from_pretrained` loads, and `load_adapter` reads such a folder
onto a split model, each rank its slices.

Gradients are dense after backward, as everywhere in tpcore.hf: the replicated halves of the
adapters (column A, row B), whose gradient each rank has a share of, are summed over TP at
the end of each backward in one all-reduce for all of them (`_SumAtEndOfBackward`), and B's
rows that copy a KV head are summed over the copies as the weight's are.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ... import comm
from ...tensor_parallel import ColumnParallelLinear, RowParallelLinear
from ...tensor_parallel.adapters import lora_adapters
from ...tensor_parallel.lora import LoRAAdapter
from ...tensor_parallel.shard_spec import ShardSpec, set_shard_spec, shard, shard_spec, unshard
from ...tensor_parallel.shared_grads import sum_over_copies
from .grads import hook_parameters

__all__ = ["is_peft_model", "take_adapters", "attach_adapters", "save_adapters", "load_adapter"]

# LoraConfig options tpcore does not carry over: option -> what it would need.
_UNSUPPORTED = {
    "use_dora": "DoRA's magnitude vector",
    "lora_bias": "a bias on lora_B",
    "modules_to_save": "full trainable copies of modules",
    "trainable_token_indices": "trainable embedding rows",
    "target_parameters": "LoRA on bare parameters",
    "layer_replication": "replicated layers",
    "use_qalora": "QA-LoRA",
}
_ADAPTER_FILE, _CONFIG_FILE = "adapter_model.safetensors", "adapter_config.json"


@dataclass
class PeftAdapter:
    """One LoRA layer PEFT made, as tpcore takes it over (whole tensors)."""

    name: str
    """The wrapped module's name in the transformers model."""
    A: torch.Tensor
    B: torch.Tensor
    rank: int
    alpha: float
    dropout: float
    requires_grad: bool


def is_peft_model(model: nn.Module) -> bool:
    """Whether `model` is a PEFT `PeftModel` (or a `LoraModel` tuner around a model)."""
    return isinstance(getattr(model, "peft_config", None), dict) and hasattr(model, "base_model")


def inner_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PeftModel (or a LoraModel)."""
    tuner = model.base_model if hasattr(model.base_model, "peft_config") else model
    return tuner.model


def _check_config(model: nn.Module) -> object:
    configs = model.peft_config
    if len(configs) != 1:
        raise ValueError(
            f"tpcore.hf: the PEFT model holds adapters {sorted(configs)}; tpcore.hf splits a model "
            "with one (delete the others, or merge them first)"
        )
    (config,) = configs.values()
    kind = str(getattr(config.peft_type, "value", config.peft_type))
    if kind != "LORA":
        raise ValueError(f"tpcore.hf: PEFT's {kind} is not supported: tpcore splits LoRA adapters")
    for option, what in _UNSUPPORTED.items():
        if getattr(config, option, None):
            raise ValueError(
                f"tpcore.hf: LoraConfig({option}={getattr(config, option)!r}) is not supported "
                f"({what}); tpcore splits plain LoRA"
            )
    return config


def take_adapters(model: nn.Module) -> tuple[nn.Module, object, list[PeftAdapter]]:
    """Check `model`'s PEFT config, replace each of its LoRA layers by the layer it wraps, and
    return (the transformers model, the LoraConfig, the adapters taken out). Raises before
    changing anything when something is not supported."""
    config = _check_config(model)
    inner = inner_model(model)
    (adapter_name,) = model.peft_config
    wrapped = [(n, m) for n, m in inner.named_modules() if hasattr(m, "lora_A")]
    for name, module in wrapped:
        if type(module).__name__ != "Linear" or not hasattr(module, "base_layer"):
            raise ValueError(
                f"tpcore.hf: PEFT's LoRA {type(module).__name__} on {name} is not supported "
                "(tpcore splits LoRA on linear layers)"
            )
        if getattr(module, "merged", False):
            raise ValueError(f"tpcore.hf: the LoRA adapter of {name} is merged; unmerge it first")
    taken = []
    for name, module in wrapped:
        dropout = module.lora_dropout[adapter_name]
        A = module.lora_A[adapter_name].weight
        taken.append(
            PeftAdapter(
                name,
                A.detach(),
                module.lora_B[adapter_name].weight.detach(),
                int(module.r[adapter_name]),
                float(module.lora_alpha[adapter_name]),
                float(dropout.p) if isinstance(dropout, nn.Dropout) else 0.0,
                A.requires_grad,
            )
        )
        parent_name, _, child = name.rpartition(".")
        setattr(inner.get_submodule(parent_name), child, module.base_layer)
    return inner, config, taken


def _kv_copies(model: nn.Module, name: str) -> tuple[int, tuple[int, int]] | None:
    """(copies, rows) when the layer `name` holds KV heads copied over several ranks."""
    plan = model.tpcore_plan
    for rep in plan.replacements:
        if rep.name == name and rep.kv_replicated:
            return plan.layout.tp_size // plan.layout.kv_heads, rep.kv_rows
    return None


class _SumAtEndOfBackward:
    """Sums over TP the gradients of the adapters' replicated halves at the end of each
    backward, all of them in one all-reduce: each parameter's hook records the gradient
    backward brings it (before it is accumulated into `.grad`), and a callback queued on the
    autograd engine adds the other ranks' shares to `.grad`. Only this backward's shares are
    summed, so gradient accumulation over micro-batches stays exact; a recomputed layer
    (gradient checkpointing) brings its share twice into the record, as into `.grad`."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
        self.params, self.group = params, group
        self.shares: dict[int, torch.Tensor] = {}
        self.queued = False
        for p in params:
            p.register_hook(functools.partial(self._record, id(p)))

    def __deepcopy__(self, memo: dict) -> "_SumAtEndOfBackward":
        # A copied model's parameters lose their hooks: hook the copies (the same objects the
        # copied model holds, through `memo`); the process group is shared, not copied.
        return _SumAtEndOfBackward([copy.deepcopy(p, memo) for p in self.params], self.group)

    def _record(self, key: int, grad: torch.Tensor) -> torch.Tensor:
        share = self.shares.get(key)
        self.shares[key] = grad.detach().clone() if share is None else share + grad
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        return grad

    def _finish(self) -> None:
        shares, self.shares, self.queued = self.shares, {}, False
        # Every parameter in a fixed order (zeros for one this backward missed): every rank
        # sends the same message.
        mine = torch.cat([shares.get(id(p), torch.zeros_like(p)).reshape(-1) for p in self.params])
        others = comm.all_reduce(mine.clone(), self.group) - mine
        with torch.no_grad():
            for p, piece in zip(self.params, others.split([p.numel() for p in self.params])):
                if p.grad is not None and id(p) in shares:
                    p.grad.add_(piece.view_as(p))


def _sum_replicated_halves(model: nn.Module) -> None:
    """One `_SumAtEndOfBackward` over every adapter's replicated half (column A, row B), whose
    shard spec then no longer says `partial_grad`: `.grad` is dense after backward."""
    halves = []
    for adapter in lora_adapters(model).values():
        half = adapter.A if adapter.column else adapter.B
        spec = shard_spec(half)
        set_shard_spec(half, dataclasses.replace(spec, partial_grad=False))
        halves.append(half)
    if halves and spec.tp_size > 1:
        model._tpcore_lora_sum = _SumAtEndOfBackward(halves, spec.group)


def _sum_kv_copies_of_B(model: nn.Module, name: str, layer: nn.Module) -> None:
    """B's rows that copy a KV head summed over the copies inside backward, as the weight's
    are (the replicated halves: `_sum_replicated_halves`)."""
    group = layer.group
    kv = _kv_copies(model, name)
    if kv is not None:
        copies, rows = kv
        through_copies = lambda p: sum_over_copies(p, group, copies, rows)  # noqa: E731
        hook_parameters(layer, through_copies, "lora", ("B",))


def _new_adapter(layer: nn.Module, name: str, rank: int, alpha: float, dropout: float, config):
    if type(layer) not in (ColumnParallelLinear, RowParallelLinear):
        raise ValueError(
            f"tpcore.hf: LoRA on {name} is not supported: tpcore.hf makes it a "
            f"{type(layer).__name__}, not a column- or row-parallel linear layer"
        )
    return LoRAAdapter(
        layer,
        rank=rank,
        alpha=alpha,
        dropout=dropout,
        use_rslora=bool(config.use_rslora),
        dtype=layer.weight.dtype,
        per_part=False,
    )


def attach_adapters(model: nn.Module, config, adapters: list[PeftAdapter]) -> None:
    """Give each split layer of `model` (tpcore.hf's transformers model) its adapter's slices."""
    for a in adapters:
        layer = model.get_submodule(a.name)
        layer.lora = _new_adapter(layer, a.name, a.rank, a.alpha, a.dropout, config)
        _fill(layer.lora, a.A, a.B, a.requires_grad)
        _sum_kv_copies_of_B(model, a.name, layer)
    _sum_replicated_halves(model)


def _fill(adapter: LoRAAdapter, A: torch.Tensor, B: torch.Tensor, requires_grad: bool) -> None:
    with torch.no_grad():
        for param, full in ((adapter.A, A), (adapter.B, B)):
            spec = shard_spec(param)
            if tuple(full.shape) != spec.global_shape:
                raise ValueError(
                    f"tpcore.hf: a LoRA tensor of shape {list(full.shape)} for an adapter of "
                    f"shape {list(spec.global_shape)}"
                )
            param.copy_(shard(full.to(param.device, param.dtype), spec))
            param.requires_grad_(requires_grad)


def save_adapters(model: nn.Module, path: str) -> None:
    """Write a split PeftModel's adapters as PEFT does (`adapter_config.json`,
    `adapter_model.safetensors`, whole tensors under PEFT's names): a collective over the TP
    group (each split half is gathered); rank 0 of the group writes."""
    from safetensors.torch import save_file

    tensors, group = {}, None
    for name, adapter in lora_adapters(inner_model(model)).items():
        for half in "AB":
            spec = shard_spec(getattr(adapter, half))
            full = unshard(getattr(adapter, half).detach(), spec)
            tensors[f"base_model.model.{name}.lora_{half}.weight"] = full.contiguous().cpu()
        group = spec.group
    if group is None or dist.get_rank(group) == 0:
        os.makedirs(path, exist_ok=True)
        (config,) = model.peft_config.values()
        config.save_pretrained(path)
        save_file(tensors, os.path.join(path, _ADAPTER_FILE), metadata={"format": "pt"})


def load_adapter(model: nn.Module, path: str) -> nn.Module:
    """Add the LoRA adapter PEFT saved in `path` to `model`, a transformers model split by
    tpcore.hf, each rank reading only its slices of the adapter tensors; returns `model`.
    The adapters train (`requires_grad`) and every other parameter keeps its flag."""
    from safetensors import safe_open

    with open(os.path.join(path, _CONFIG_FILE), encoding="utf-8") as f:
        config = json.load(f)
    if config.get("peft_type") != "LORA":
        raise ValueError(f"tpcore.hf: {path} holds a {config.get('peft_type')} adapter, not LoRA")
    for option, what in _UNSUPPORTED.items():
        if config.get(option):
            raise ValueError(
                f"tpcore.hf: {path}: {option}={config[option]!r} is not supported ({what})"
            )
    if lora_adapters(model):
        raise ValueError("tpcore.hf: load_adapter: the model has LoRA adapters already")
    file = os.path.join(path, _ADAPTER_FILE)
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    options = type("Options", (), {"use_rslora": bool(config.get("use_rslora"))})
    modules = dict(model.named_modules())
    with safe_open(file, framework="pt") as stored:
        halves: dict[str, set[str]] = {}
        for key in stored.keys():
            found = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])\.weight", key)
            if found is None:
                raise ValueError(f"tpcore.hf: {file}: {key} is not a LoRA A or B weight")
            halves.setdefault(found[1], set()).add(found[2])
        lacking = sorted(n for n in halves if n not in modules)
        if lacking:
            raise ValueError(
                f"tpcore.hf: {path} adapts modules the model does not have ({lacking[:3]}): an "
                "adapter of another base model?"
            )
        for name in sorted(halves):
            if halves[name] != {"A", "B"}:
                raise ValueError(f"tpcore.hf: {file} holds only lora_{min(halves[name])} of {name}")
            layer = modules[name]
            rank = int(_pattern(rank_pattern, name, config["r"]))
            alpha = float(_pattern(alpha_pattern, name, config["lora_alpha"]))
            dropout = float(config.get("lora_dropout") or 0.0)
            layer.lora = _new_adapter(layer, name, rank, alpha, dropout, options)
            for half in "AB":
                param = getattr(layer.lora, half)
                _read_slices(stored.get_slice(f"base_model.model.{name}.lora_{half}.weight"), param)
            _sum_kv_copies_of_B(model, name, layer)
    _sum_replicated_halves(model)
    return model


def _pattern(pattern: dict, name: str, default):
    for key, value in pattern.items():
        if re.fullmatch(rf"(.*\.)?{key}", name):
            return value
    return default


def _read_slices(stored, param: nn.Parameter) -> None:
    """This rank's piece of a stored tensor, read slice by slice (never the whole)."""
    spec: ShardSpec = shard_spec(param)
    if list(stored.get_shape()) != list(spec.global_shape):
        raise ValueError(
            f"tpcore.hf: a stored LoRA tensor of shape {stored.get_shape()} for an adapter of "
            f"shape {list(spec.global_shape)} (another base model?)"
        )
    with torch.no_grad():
        if spec.kind == "replicated":
            param.copy_(stored[:])
            return
        dim, ranges = spec.ranges()
        for local, start, n in ranges:
            index = (
                (slice(start, start + n),) if dim == 0 else (slice(None), slice(start, start + n))
            )
            param.narrow(dim, local, n).copy_(stored[index])
