"""Hugging Face weights into a GPTModel, each rank reading only its slices.

    config = config_from_hf(path)
    model = GPTModel(config)                  # or build_gpt_stages(config, ...): any stage or chunk
    load_hf_weights(model, path)              # model.safetensors or a sharded index

`hf_sources` names, for each GPTModel parameter, the Hugging Face tensors whose
concatenation along the parameter's split dim (its shard spec) is the full
parameter: Llama's q / k / v are the parts of the fused QKV's shard spec, gate / up those of
SwiGLU's fc1; GPT-2's Conv1D weights are stored `[in, out]` (transposed). A rank's piece is
the ranges its parameter's shard spec gives, mapped onto those tensors and read with ranged
reads (`safetensors_io`): whole heads of Q, K and V, the padded vocabulary rows zero.

MoE layers: the router, the shared expert and its gate map like the dense tensors. The
experts `[experts, ...]` are read in either layout transformers loads: fused, one tensor
per projection (`mlp.experts.gate_up_proj [experts, 2f, h]`, `mlp.experts.down_proj`: how
transformers 5 holds them), read with ranged reads of this rank's experts; or one tensor per
expert and projection (`experts.{e}.w1 / w3 / w2` in Mixtral's `block_sparse_moe`,
`experts.{e}.gate_proj / up_proj / down_proj` in Qwen-MoE's `mlp`: what `save_pretrained`
writes, and older checkpoints hold), of which a rank reads its experts' only
(`expert_sources`).

Every rank checks the folder's config and every tensor's shape for the whole model (not
only its stage) from the headers before reading anything, and no collective runs: a bad
folder raises the same error on every rank.
"""

from __future__ import annotations

import os
import re
from typing import Sequence

import torch
from torch import nn

from ...models.config import GPTConfig
from ...models.gpt_specs import gpt_shard_specs
from ...safetensors_io import SafetensorsFolder
from ...tensor_parallel.shard_spec import ShardSpec, shard_spec
from .config import config_from_hf, hf_family, read_hf_config

__all__ = [
    "load_hf_weights",
    "hf_sources",
    "expert_sources",
    "source_shapes",
    "ARCHITECTURE_FIELDS",
]

ARCHITECTURE_FIELDS = (
    "vocab_size",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "ffn_hidden_size",
    "kv_channels",
    "qk_norm",
    "qk_norm_scope",
    "norm",
    "norm_eps",
    "activation",
    "position_embedding",
    "rotary_base",
    "rotary_scaling",
    "tie_embeddings",
    "bias",
    "qkv_bias",
    "proj_bias",
    "mlp_bias",
    "embedding_scale",
    "num_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "moe_router_score_function",
    "moe_norm_topk_prob",
    "moe_router_topk_scaling_factor",
)
"""GPTConfig fields a Hugging Face folder fixes (max_position_embeddings too, with learned
positions; which layers are MoE, too; ffn_hidden_size only where some layer is dense)."""

_LLAMA_LAYER = {
    "input_norm": ["input_layernorm"],
    "attention.qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    "attention.proj": ["self_attn.o_proj"],
    "attention.q_norm": ["self_attn.q_norm"],  # Qwen3, OLMoE
    "attention.k_norm": ["self_attn.k_norm"],
    "post_attention_norm": ["post_attention_layernorm"],
    "mlp.fc1": ["mlp.gate_proj", "mlp.up_proj"],
    "mlp.fc2": ["mlp.down_proj"],
}
# The MoE layers' tensors, by family; the experts' are `expert_sources` (or fused: `_FUSED`).
_MOE_LAYER = {
    "mixtral": {"mlp.router": ["block_sparse_moe.gate"]},
    "qwen_moe": {
        "mlp.router": ["mlp.gate"],
        "mlp.shared_expert.fc1": ["mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"],
        "mlp.shared_expert.fc2": ["mlp.shared_expert.down_proj"],
        "mlp.shared_expert_gate": ["mlp.shared_expert_gate"],
    },
}
# Per expert e: (HF name under `experts.{e}.`, GPTModel parameter, its row offset as a
# fraction of the expert's rows: gate rows first, then up, as transformers concatenates).
_EXPERT_PARTS = {
    "mixtral": {"fc1": [("w1", 0), ("w3", 1)], "fc2": [("w2", 0)]},
    "qwen_moe": {"fc1": [("gate_proj", 0), ("up_proj", 1)], "fc2": [("down_proj", 0)]},
}
_EXPERTS_MODULE = {"mixtral": "block_sparse_moe.experts", "qwen_moe": "mlp.experts"}
# transformers 5's own names of the fused expert tensors (any family: its MoE blocks are `mlp`).
_FUSED = {"fc1": "mlp.experts.gate_up_proj", "fc2": "mlp.experts.down_proj"}
_GPT2_LAYER = {
    "input_norm": ["ln_1"],
    "attention.qkv": ["attn.c_attn"],
    "attention.proj": ["attn.c_proj"],
    "post_attention_norm": ["ln_2"],
    "mlp.fc1": ["mlp.c_fc"],
    "mlp.fc2": ["mlp.c_proj"],
}
_TOP = {
    "llama": {
        "embedding.word": "model.embed_tokens",
        "final_norm": "model.norm",
        "lm_head": "lm_head",
    },
    "gpt2": {
        "embedding.word": "transformer.wte",
        "embedding.position": "transformer.wpe",
        "final_norm": "transformer.ln_f",
        "lm_head": "lm_head",
    },
}
_TOP["mixtral"] = _TOP["qwen_moe"] = _TOP["llama"]
_PREFIX = {"llama": "model.", "gpt2": "transformer.", "mixtral": "model.", "qwen_moe": "model."}


def hf_sources(name: str, family: str) -> list[tuple[str, bool]]:
    """The Hugging Face tensors `(key, stored transposed)` making GPTModel parameter `name`
    (global layer indices), concatenated along its split dim; keys as transformers saves
    a `*ForCausalLM` (`model.…` / `transformer.…`). An MoE layer's experts give their
    fused tensor (`mlp.experts.gate_up_proj`; `expert_sources` gives the per-expert ones)."""
    module, kind = name.rsplit(".", 1)
    if module.startswith("layers."):
        _, index, rest = module.split(".", 2)
        if rest.startswith("mlp.experts."):
            return [(f"{_PREFIX[family]}layers.{index}.{_FUSED[rest.rsplit('.', 1)[1]]}", False)]
        table = _GPT2_LAYER if family == "gpt2" else {**_LLAMA_LAYER, **_MOE_LAYER.get(family, {})}
        if rest not in table:
            raise KeyError(f"tpcore: no Hugging Face tensor for {name}")
        # GPT-2's Conv1D weights are [in, out]: transposed against nn.Linear's [out, in].
        transposed = family == "gpt2" and kind == "weight" and not rest.endswith("norm")
        return [
            (
                f"{_PREFIX[family]}{'h' if family == 'gpt2' else 'layers'}.{index}.{part}.{kind}",
                transposed,
            )
            for part in table[rest]
        ]
    if module not in _TOP[family]:
        raise KeyError(f"tpcore: no Hugging Face tensor for {name}")
    return [(f"{_TOP[family][module]}.{kind}", False)]


def expert_sources(name: str, family: str, spec: ShardSpec) -> list[tuple[str, int, int, int]]:
    """The per-expert Hugging Face tensors of the expert weight `name`
    (`layers.i.mlp.experts.fc1.weight [experts, rows, cols]`, `spec` its shard spec), as
    `(key, expert, first row, rows)`: tensor `key` is rows `[first, first + rows)` of that
    expert's `[rows, cols]` matrix (Mixtral's w1 the gate rows of fc1, w3 the up rows). In
    the parameter's order: expert by expert, gate before up."""
    module = name.rsplit(".", 1)[0]  # layers.i.mlp.experts.fc1
    _, index, rest = module.split(".", 2)
    parts = _EXPERT_PARTS[family][rest.rsplit(".", 1)[1]]
    experts, rows = spec.global_shape[0], spec.global_shape[1] // len(parts)
    head = f"{_PREFIX[family]}layers.{index}.{_EXPERTS_MODULE[family]}"
    return [
        (f"{head}.{e}.{part}.weight", e, k * rows, rows)
        for e in range(experts)
        for part, k in parts
    ]


def source_shapes(spec: ShardSpec, count: int) -> list[list[int]]:
    """The full shape of each of `count` source tensors of the parameter `spec` describes,
    in the parameter's orientation: one source is the whole; several are its parts."""
    shape = list(spec.global_shape)
    if count == 1:
        return [shape]
    if len(spec.parts) != count:
        raise ValueError(
            f"tpcore: {count} Hugging Face tensors for a parameter of {len(spec.parts)} parts"
        )
    return [[p.size if d == spec.dim else n for d, n in enumerate(shape)] for p in spec.parts]


class HFFolder:
    """A Hugging Face model folder: its config (checked against a GPTConfig) and tensors
    (found with or without the base-model prefix, as transformers does)."""

    def __init__(self, path: str, config: GPTConfig) -> None:
        if not os.path.isdir(path):
            raise FileNotFoundError(f"tpcore: Hugging Face model folder {path} does not exist")
        self.path, self.config = path, config
        hf = read_hf_config(path)
        self.family = hf_family(hf.get("model_type"))
        folder_config = config_from_hf(hf)
        dense = [i for i in range(config.num_layers) if not config.is_moe_layer(i)]
        fields = [
            k
            for k in ARCHITECTURE_FIELDS
            if k != "ffn_hidden_size" or dense  # without dense layers nothing is that wide
        ] + (["max_position_embeddings"] if config.position_embedding == "learned" else [])
        diff = [
            f"{k}: folder {getattr(folder_config, k)!r}, model {getattr(config, k)!r}"
            for k in fields
            if getattr(folder_config, k) != getattr(config, k)
        ]
        theirs = [i for i in range(folder_config.num_layers) if not folder_config.is_moe_layer(i)]
        if config.num_experts is not None and theirs != dense:
            diff.append(f"dense (not MoE) layers: folder {theirs}, model {dense}")
        if diff:
            raise ValueError(
                f"tpcore: {path}/config.json does not describe this model ({'; '.join(diff)})"
            )
        self.tensors = SafetensorsFolder(path)
        self._experts_found: dict[str, set[int]] | None = None

    def key(self, key: str) -> str:
        """The folder's name for `key` (as is, or without / with the family's prefix; a
        Mixtral `block_sparse_moe` tensor also under transformers 5's name, `mlp`)."""
        prefix = _PREFIX[self.family].rstrip(".")
        found = self.tensors.find(key, prefix)
        if found is None and ".block_sparse_moe." in key:
            found = self.tensors.find(key.replace(".block_sparse_moe.", ".mlp."), prefix)
        if found is None:
            raise KeyError(key)
        return found

    def fused(self, name: str) -> bool:
        """Whether expert weight `name`'s experts are stored in one fused tensor."""
        try:
            self.key(hf_sources(name, self.family)[0][0])
        except KeyError:
            return False
        return True

    def experts_found(self, name: str) -> set[int]:
        """The expert indices the folder has per-expert tensors of, in `name`'s layer."""
        if self._experts_found is None:
            found: dict[str, set[int]] = {}
            pattern = re.compile(
                r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
            )
            for key in self.tensors.files:
                match = pattern.search(key)
                if match:
                    found.setdefault(match.group(1), set()).add(int(match.group(2)))
            self._experts_found = found
        return self._experts_found.get(name.split(".")[1], set())

    def _check_experts(self, name: str, spec: ShardSpec) -> None:
        """Expert weight `name` is there, fused or per expert, with the config's number of
        experts and shapes (a folder of another expert count: an error naming both)."""
        experts = spec.global_shape[0]
        if self.fused(name):
            found = self.key(hf_sources(name, self.family)[0][0])
            stored, file = self.tensors.stored_shape(found)
            if stored and stored[0] != experts:
                raise ValueError(
                    f"tpcore: {self.path}: tensor {found!r} in {file} holds {stored[0]} experts, "
                    f"the config gives {experts} (num_experts; num_local_experts in a Mixtral "
                    "config.json)"
                )
            if stored != list(spec.global_shape):
                raise ValueError(
                    f"tpcore: {self.path}/config.json contradicts the weights: tensor "
                    f"{found!r} is {stored} in {file}, the config gives {list(spec.global_shape)}"
                )
            return
        present = self.experts_found(name)
        if present and present != set(range(experts)):
            raise ValueError(
                f"tpcore: {self.path} holds {len(present)} experts in layer {name.split('.')[1]} "
                f"(indices {min(present)}..{max(present)}), the config gives {experts} "
                "(num_experts; num_local_experts in a Mixtral config.json)"
            )
        for key, _, _, rows in expert_sources(name, self.family, spec):
            try:
                found = self.key(key)
            except KeyError:
                fused = hf_sources(name, self.family)[0][0]
                raise ValueError(
                    f"tpcore: {self.path} has no tensor {key!r} nor {fused!r} "
                    f"(GPTModel's {name}); a shard missing from the index?"
                ) from None
            stored, file = self.tensors.stored_shape(found)
            if stored != [rows, spec.global_shape[2]]:
                raise ValueError(
                    f"tpcore: {self.path}/config.json contradicts the weights: tensor "
                    f"{found!r} is {stored} in {file}, the config gives "
                    f"{[rows, spec.global_shape[2]]}"
                )

    def check(self) -> None:
        """Every tensor the whole model needs is there with the shape the config gives."""
        specs = gpt_shard_specs(self.config)
        # The experts first: a folder of another expert count is told as such, not as a
        # router of another shape.
        for name, spec in specs.items():
            if spec.axis == "expert":
                self._check_experts(name, spec)
        for name, spec in specs.items():
            if spec.axis == "expert":
                continue
            sources = self.sources(name)
            for (key, transposed), want in zip(sources, source_shapes(spec, len(sources))):
                try:
                    found = self.key(key)
                except KeyError:
                    raise ValueError(
                        f"tpcore: {self.path} has no tensor {key!r} "
                        f"(GPTModel's {name}); a shard missing from the index?"
                    ) from None
                stored, file = self.tensors.stored_shape(found)
                stored = stored[::-1] if transposed else stored
                if stored != want:
                    shown = want[::-1] if transposed else want
                    raise ValueError(
                        f"tpcore: {self.path}/config.json contradicts the weights: "
                        f"tensor {found!r} is {self.tensors.stored_shape(found)[0]} "
                        f"in {file}, the config gives {shown}"
                    )

    def sources(self, name: str) -> list[tuple[str, bool]]:
        """`hf_sources` of this folder's family."""
        return hf_sources(name, self.family)

    def read_piece(self, name: str, out: torch.Tensor, spec: ShardSpec) -> None:
        """Fill `out` (the piece `spec` describes of parameter `name`) from the folder."""
        if spec.axis == "expert" and not self.fused(name):
            # This rank's experts only, each from its own tensors.
            _, ranges = spec.ranges()
            first, last = ranges[0][1], ranges[-1][1] + ranges[-1][2]
            local = {start + i: at + i for at, start, n in ranges for i in range(n)}
            for key, expert, row, rows in expert_sources(name, self.family, spec):
                if first <= expert < last:
                    piece = self.tensors.read(self.key(key))
                    out[local[expert]].narrow(0, row, rows).copy_(piece)
            return
        sources = self.sources(name)
        if spec.kind == "replicated":
            ((key, transposed),) = sources
            full = self.tensors.read(self.key(key))
            out.copy_(full.t() if transposed else full)
            return
        dim, ranges = spec.ranges()
        if spec.kind == "vocab":
            covered = sum(n for _, _, n in ranges)
            out.narrow(0, covered, out.shape[0] - covered).zero_()  # padding rows
        offset = 0
        for (key, transposed), source_shape in zip(sources, source_shapes(spec, len(sources))):
            length = source_shape[dim]
            # This rank's ranges inside [offset, offset + length), in source coordinates.
            wanted = [
                (
                    local + max(start, offset) - start,
                    max(start, offset) - offset,
                    min(start + n, offset + length) - offset,
                )
                for local, start, n in ranges
                if max(start, offset) < min(start + n, offset + length)
            ]
            if wanted:
                stored_dim = (1 - dim) if transposed and out.dim() == 2 else dim
                piece = self.tensors.read(
                    self.key(key), stored_dim, [(lo, hi) for _, lo, hi in wanted]
                )
                piece = piece.t() if transposed and out.dim() == 2 else piece
                at = 0
                for local, lo, hi in wanted:
                    out.narrow(dim, local, hi - lo).copy_(piece.narrow(dim, at, hi - lo))
                    at += hi - lo
            offset += length


def load_hf_weights(model_or_chunks: nn.Module | Sequence[nn.Module], path: str) -> None:
    """Fill a GPTModel (or this rank's pipeline chunks) from the Hugging Face folder `path`
    (`model.safetensors` or `model.safetensors.index.json` + shards), converting to the
    parameters' dtype. Each rank reads only its TP slices of its stages' tensors; no
    collective runs. Raises on every rank alike, before any parameter is written, when the
    folder's config does not describe the model or a tensor is missing or misshapen."""
    chunks = [model_or_chunks] if isinstance(model_or_chunks, nn.Module) else list(model_or_chunks)
    if not chunks:
        raise ValueError("tpcore: load_hf_weights: no model chunks given")
    first = chunks[0]
    folder = HFFolder(path, first.config)
    folder.check()
    with torch.no_grad():
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                folder.read_piece(name, param, shard_spec(param))
