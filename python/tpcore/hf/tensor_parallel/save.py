"""`tpcore.hf.save_pretrained`: a model split by tpcore.hf written as transformers (or PEFT)
writes it, so that `from_pretrained` of either loads it dense."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from ...tensor_parallel.shard_spec import shard_spec, unshard
from .peft_lora import is_peft_model, save_adapters

__all__ = ["save_pretrained"]


def _group(model: nn.Module) -> dist.ProcessGroup:
    plan = getattr(model, "tpcore_plan", None)
    groups = [m.group for m in model.modules() if hasattr(m, "group") and hasattr(m, "tp_size")]
    if plan is None or not groups:
        raise ValueError(
            f"tpcore.hf: save_pretrained: {type(model).__name__} was not split by tpcore.hf "
            "(save a dense model with its own save_pretrained)"
        )
    return groups[0]


def save_pretrained(model: nn.Module, path: str) -> str:
    """Write `model` (split by `tpcore.hf.parallelize` or `from_pretrained`) to the folder
    `path` and return it: a PeftModel's LoRA adapters as PEFT writes them (`adapter_config.json`,
    `adapter_model.safetensors`; `PeftModel.from_pretrained(base, path)` loads them), any
    other model whole (`config.json`, `model.safetensors`; `AutoModel*.from_pretrained(path)`
    loads it). A collective over the TP group (the split tensors are gathered): call it on
    every rank; rank 0 of the group writes."""
    if is_peft_model(model):
        save_adapters(model, path)
        return path
    group = _group(model)
    # GPT-2's Conv1D stores its weight [in, out]; the layers hold it [out, in].
    transposed = {
        f"{rep.name}.{attr}"
        for rep in model.tpcore_plan.replacements
        for attr, load in rep.loads.items()
        if load.transpose
    }
    state = {}
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied weight once, as transformers saves
            full = unshard(param.detach(), shard_spec(param), group)
            state[name] = (full.t() if name in transposed else full).contiguous().cpu()
    if dist.get_rank(group) == 0:
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        model.config.save_pretrained(path)
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(path)
        save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path
