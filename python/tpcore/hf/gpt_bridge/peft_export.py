"""A GPTModel's LoRA adapters written for PEFT (the trainer's `--save-peft`): the folder
`peft.PeftModel.from_pretrained(hf_model, folder)` loads onto the Hugging Face model
`export_hf` (or `--load-hf`) names, so that it computes what the GPTModel computes.

GPTModel adapts its fused q|k|v and gate|up layers per part. Where the Hugging Face model
splits that layer into projections (Llama's q_proj / k_proj / v_proj, gate_proj / up_proj),
each part's A and B become that projection's adapter. Where it keeps the layer fused
(GPT-2's c_attn), the parts become one adapter of rank parts x r, A the parts' A's stacked,
B block-diagonal, its alpha scaled alike so that alpha / r is unchanged (PEFT's
`rank_pattern` and `alpha_pattern`).
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ...agreement import all_or_none
from ...tensor_parallel.adapters import lora_adapters
from ...tensor_parallel.shard_spec import shard_spec, unshard
from .config import config_to_hf, hf_family
from .weights import hf_sources

__all__ = ["export_peft_adapters"]


def _peft_tensors(name: str, A: torch.Tensor, B: torch.Tensor, rank: int, family: str, spec):
    """PEFT's tensors for the GPTModel layer `name` (whole A and B), and per Hugging Face
    module its rank when it is not `rank` (fused parts: block-diagonal)."""
    sources = [key.removesuffix(".weight") for key, _ in hf_sources(f"{name}.weight", family)]
    parts = A.shape[0] // rank
    sizes = [p.size for p in spec.parts] if parts > 1 else [B.shape[0]]
    A_parts, B_parts = A.split(rank, 0), B.split(sizes, 0)
    tensors, ranks = {}, {}
    if len(sources) == parts:  # one projection per part
        for module, a, b in zip(sources, A_parts, B_parts):
            tensors[module] = (a, b)
    else:  # one fused projection: rank parts x r, B block-diagonal
        (module,) = sources
        block = torch.zeros(B.shape[0], parts * rank, dtype=B.dtype)
        row = 0
        for p, b in enumerate(B_parts):
            block[row : row + b.shape[0], p * rank : (p + 1) * rank] = b
            row += b.shape[0]
        tensors[module], ranks[module] = (A, block), parts * rank
    return tensors, ranks


def export_peft_adapters(
    chunks: Sequence[nn.Module],
    out_dir: str,
    *,
    lora: dict,
    base_model: str | None,
    pp_group: dist.ProcessGroup | None,
    dp_group: dist.ProcessGroup | None,
) -> str:
    """Write this run's adapters (every rank's pipeline `chunks`; `lora` the settings the
    trainer records) to `out_dir` as PEFT does. A collective over every rank: adapters are
    gathered over TP, then over PP to the first stage's TP rank 0 of DP replica 0, which
    writes `adapter_config.json` and `adapter_model.safetensors`; every rank raises if
    writing failed. Returns `out_dir`."""
    from safetensors.torch import save_file

    first = chunks[0]
    config = first.config
    family = hf_family(config_to_hf(config)["model_type"])
    rank = lora["rank"]
    mine: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    ranks: dict[str, int] = {}
    for chunk in chunks:
        for name, adapter in lora_adapters(chunk).items():
            A, B = (
                unshard(p.detach(), shard_spec(p)).float().cpu() for p in (adapter.A, adapter.B)
            )
            spec = shard_spec(chunk.get_submodule(name).weight)
            tensors, fused = _peft_tensors(name, A, B, rank, family, spec)
            mine.update(tensors)
            ranks.update(fused)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        every: list = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(every, (mine, ranks), group=pp_group)
        mine = {k: v for part, _ in every for k, v in part.items()}
        ranks = {k: v for _, part in every for k, v in part.items()}
    writer = (
        (pp_group is None or dist.get_rank(pp_group) == 0)
        and first.tp_rank == 0
        and (dp_group is None or dist.get_rank(dp_group) == 0)
    )

    def write() -> None:
        if not writer:
            return
        os.makedirs(out_dir, exist_ok=True)
        tensors = {}
        for module, (a, b) in sorted(mine.items()):
            tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
            tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
        save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"), {"format": "pt"})
        settings = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": rank,
            "lora_alpha": lora["alpha"],
            "lora_dropout": lora["dropout"],
            "use_rslora": lora["use_rslora"],
            "target_modules": sorted({m.rsplit(".", 1)[-1] for m in mine}),
            "rank_pattern": dict(ranks),
            "alpha_pattern": {
                m: lora["alpha"] * (r / rank) ** (0.5 if lora["use_rslora"] else 1.0)
                for m, r in ranks.items()
            },  # the same scale at the fused module's rank
            "fan_in_fan_out": family == "gpt2",  # GPT-2's Conv1D
            "bias": "none",
            "inference_mode": False,
        }
        with open(os.path.join(out_dir, "adapter_config.json"), "w", encoding="utf-8") as f:
            json.dump(settings, f, indent=2)

    device = next(first.parameters()).device
    all_or_none(write, f"writing the LoRA adapters to {out_dir}", device)
    return out_dir
