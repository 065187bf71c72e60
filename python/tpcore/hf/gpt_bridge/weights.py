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

Every rank checks the folder's config and every tensor's shape for the whole model (not
only its stage) from the headers before reading anything, and no collective runs: a bad
folder raises the same error on every rank.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
from torch import nn

from ...models.config import GPTConfig
from ...models.gpt_specs import gpt_shard_specs
from ...safetensors_io import SafetensorsFolder
from ...tensor_parallel.shard_spec import ShardSpec, shard_spec
from .config import config_from_hf, hf_family, read_hf_config

__all__ = ["load_hf_weights", "hf_sources", "source_shapes", "ARCHITECTURE_FIELDS"]

ARCHITECTURE_FIELDS = (
    "vocab_size",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "ffn_hidden_size",
    "kv_channels",
    "qk_norm",
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
)
"""GPTConfig fields a Hugging Face folder fixes (max_position_embeddings too, with learned
positions)."""

_LLAMA_LAYER = {
    "input_norm": ["input_layernorm"],
    "attention.qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    "attention.proj": ["self_attn.o_proj"],
    "attention.q_norm": ["self_attn.q_norm"],  # Qwen3
    "attention.k_norm": ["self_attn.k_norm"],
    "post_attention_norm": ["post_attention_layernorm"],
    "mlp.fc1": ["mlp.gate_proj", "mlp.up_proj"],
    "mlp.fc2": ["mlp.down_proj"],
}
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
_PREFIX = {"llama": "model.", "gpt2": "transformer."}


def hf_sources(name: str, family: str) -> list[tuple[str, bool]]:
    """The Hugging Face tensors `(key, stored transposed)` making GPTModel parameter `name`
    (global layer indices), concatenated along its split dim; keys as transformers saves
    a `*ForCausalLM` (`model.…` / `transformer.…`)."""
    module, kind = name.rsplit(".", 1)
    if module.startswith("layers."):
        _, index, rest = module.split(".", 2)
        table = _LLAMA_LAYER if family == "llama" else _GPT2_LAYER
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
        fields = ARCHITECTURE_FIELDS + (
            ("max_position_embeddings",) if config.position_embedding == "learned" else ()
        )
        diff = [
            f"{k}: folder {getattr(folder_config, k)!r}, model {getattr(config, k)!r}"
            for k in fields
            if getattr(folder_config, k) != getattr(config, k)
        ]
        if diff:
            raise ValueError(
                f"tpcore: {path}/config.json does not describe this model ({'; '.join(diff)})"
            )
        self.tensors = SafetensorsFolder(path)

    def key(self, key: str) -> str:
        """The folder's name for `key` (as is, or without / with the family's prefix)."""
        found = self.tensors.find(key, _PREFIX[self.family].rstrip("."))
        if found is None:
            raise KeyError(key)
        return found

    def check(self) -> None:
        """Every tensor the whole model needs is there with the shape the config gives."""
        for name, spec in gpt_shard_specs(self.config).items():
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
