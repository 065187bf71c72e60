"""GPTConfig <-> Hugging Face `config.json` for the families GPTModel computes exactly.

    # a folder, its config.json, a dict or a transformers config
    config = config_from_hf("path/to/llama")
    json.dump(config_to_hf(config), open("config.json", "w"))

Families: `gpt2` (LayerNorm, tanh or erf GeLU, learned positions, biases everywhere) and the
Llama shape `llama`, `mistral`, `qwen2`, `qwen3`, `gemma` (RMSNorm, SwiGLU, rotary, GQA;
Qwen2 has q/k/v biases only, Qwen3 q/k norms; Gemma (1 + weight) norms, GeGLU, embeddings
scaled by sqrt(hidden) and a tied head; head_dim other than hidden / heads is kv_channels).
Mixture-of-experts families: `mixtral` (every layer's MLP routed, top-k renormalised, no
biases), `qwen3_moe` (Qwen3's q / k norms; dense layers where `mlp_only_layers` or
`decoder_sparse_step` say) and `qwen2_moe` (Qwen2's q/k/v biases and a shared expert gated by
sigmoid(x . w) beside the routed ones), `olmoe` (q / k norms over the whole projection,
`qk_norm_scope="projection"`; every layer routed, top-k weights unnormalised by default).
`router_aux_loss_coef` becomes `moe_aux_loss_coeff`
times `num_experts_per_tok`: transformers' balancing loss (`load_balancing_loss_func`) counts
the tokens each expert takes where Megatron (and tpcore) count the routes, k per token, so
one layer's loss is then the same number. transformers adds that loss to the training loss
only with `output_router_logits`, so without it the coefficient is 0 (the export writes the
flag and the coefficient back). Two differences remain: transformers averages the counts
and probabilities over the layers before multiplying, tpcore sums each layer's loss
(Megatron's); and transformers computes the router's logits in the model's dtype, tpcore in
float32 (the same in float32). Mixtral's `router_jitter_noise` and OLMoE's `clip_qkv` are
refused.
Both spellings of the rotary settings transformers has written are read (`rope_theta` +
`rope_scaling` up to 4.x, `rope_parameters` from 5.x) and both are written, so either
version loads the export. Anything GPTModel does not compute exactly (another rotary
scaling, partial rotary, GPT-NeoX's parallel residual, ...) raises a ValueError naming the
option. No transformers import.
"""

from __future__ import annotations

import json
import os

from ...models.config import GPTConfig

__all__ = ["SUPPORTED_MODEL_TYPES", "config_from_hf", "config_to_hf", "read_hf_config", "hf_family"]

SUPPORTED_MODEL_TYPES = (
    "gpt2",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
)
_LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "gemma")
# Parameter-name families of the MoE model types (`hf_family`).
_MOE_FAMILIES = {
    "mixtral": "mixtral",
    "qwen2_moe": "qwen_moe",
    "qwen3_moe": "qwen_moe",
    "olmoe": "qwen_moe",  # the same tensor names (its q / k norms are wider)
}
_ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
# Why the families transformers has and GPTModel lacks are refused (the first thing each needs).
_MISSING = {
    "gpt_neox": "GPT-NeoX's parallel residual and partial rotary embeddings",
    "gptj": "GPT-J's parallel residual and interleaved partial rotary embeddings",
    "falcon": "Falcon's parallel attention / MLP",
    "phi": "Phi's parallel residual and partial rotary embeddings",
    "gemma2": "Gemma 2's logit soft-capping and extra norms around attention and MLP",
}
_GPT2_ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact"}


def read_hf_config(source) -> dict:
    """The config dict of `source`: a folder holding `config.json`, a path to such a file,
    a dict, or a transformers config object (anything with `to_dict()`)."""
    if isinstance(source, dict):
        return dict(source)
    if hasattr(source, "to_dict"):
        return source.to_dict()
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            "tpcore: GPTConfig.from_hf takes a folder, a config.json path, "
            f"a dict or a transformers config, got {type(source).__name__}"
        )
    path = os.path.join(source, "config.json") if os.path.isdir(source) else str(source)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"tpcore: {path} does not exist (a Hugging Face model folder holds a config.json)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except ValueError as e:  # bad JSON or not UTF-8
        raise ValueError(f"tpcore: {path} is not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(
            f"tpcore: {path} holds a JSON {type(config).__name__}, not a config object"
        )
    return config


def hf_family(model_type: str | None) -> str:
    """The parameter names and layout of `model_type`: "gpt2", "llama" (Mistral, Qwen2,
    Qwen3 and Gemma share Llama's), "mixtral" or "qwen_moe" (Llama's attention and MoE
    layers under their names); a ValueError naming an unsupported type and why."""
    if model_type == "gpt2":
        return "gpt2"
    if model_type in _LLAMA_LIKE:
        return "llama"
    if model_type in _MOE_FAMILIES:
        return _MOE_FAMILIES[model_type]
    why = f" (GPTModel has no {_MISSING[model_type]})" if model_type in _MISSING else ""
    raise ValueError(
        f"tpcore: Hugging Face model_type {model_type!r} is not "
        f"supported{why}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )


def _unsupported(model_type: str, option: str, value) -> ValueError:
    return ValueError(
        f"tpcore: {model_type} option {option}={value!r} is not supported by GPTModel"
    )


def _rotary(d: dict, model_type: str) -> tuple[float, dict | None]:
    """(base, GPTConfig.rotary_scaling) from either spelling of the rope settings."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        raise _unsupported(model_type, "rope_parameters per layer type", sorted(params))
    if isinstance(params, dict) and params:
        base, scaling = params.get("rope_theta", d.get("rope_theta", 10000.0)), params
    else:
        base, scaling = d.get("rope_theta", 10000.0), d.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    partial = scaling.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise _unsupported(model_type, "partial_rotary_factor", partial)
    if kind == "default":
        return float(base), None
    if kind == "linear":
        return float(base), {"rope_type": "linear", "factor": scaling["factor"]}
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in scaling]
        if missing:
            raise ValueError(f"tpcore: {model_type} llama3 rope scaling lacks {missing}")
        return float(base), {"rope_type": "llama3", **{k: scaling[k] for k in keys}}
    raise _unsupported(model_type, "rope scaling rope_type", kind)


def _sliding_window(d: dict, model_type: str, num_layers: int) -> int | None:
    """The attention window where some layer uses one and it is shorter than the context."""
    window = d.get("sliding_window")
    if model_type in ("qwen2", "qwen3"):
        # transformers' defaults where config.json leaves a key out: a 4096 window from layer 28.
        window = d.get("sliding_window", 4096)
        types = d.get("layer_types")
        used = (
            "sliding_attention" in types
            if types
            else (d.get("use_sliding_window") and num_layers > d.get("max_window_layers", 28))
        )
        window = window if used else None
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        # Qwen3-MoE windows every layer when use_sliding_window; Qwen2-MoE the layers that
        # layer_types names (saved with its config; else use_sliding_window decides). Qwen2-MoE
        # writes a 0 window when unused.
        types = d.get("layer_types") if model_type == "qwen2_moe" else None
        used = "sliding_attention" in types if types else bool(d.get("use_sliding_window"))
        window = d.get("sliding_window", 4096) if used else None
    if window is None or window >= d.get("max_position_embeddings", window):
        return None  # a window as long as the context changes nothing
    return int(window)


def _gemma(d: dict) -> dict:
    """What Gemma changes in the Llama shape."""
    # transformers reads the legacy "gelu" as the tanh approximation; older configs name it
    # hidden_activation.
    act = d.get("hidden_activation") or d.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu"):
        raise _unsupported("gemma", "hidden_act", act)
    if d.get("use_bidirectional_attention"):
        raise _unsupported("gemma", "use_bidirectional_attention", d["use_bidirectional_attention"])
    return dict(
        norm="gemma_rmsnorm",
        activation="geglu",
        embedding_scale=d["hidden_size"] ** 0.5,
        tie_embeddings=bool(d.get("tie_word_embeddings", True)),
    )


def _moe(d: dict, model_type: str) -> dict:
    """The GPTConfig `moe_*` fields of an MoE family (module doc); {} for a Qwen-MoE
    config without experts (transformers builds every MLP dense then)."""
    mixtral = model_type == "mixtral"
    if mixtral and d.get("router_jitter_noise", 0.0):
        raise _unsupported(model_type, "router_jitter_noise", d["router_jitter_noise"])
    spellings = ("num_local_experts", "num_experts")
    experts = next((d[k] for k in (spellings if mixtral else spellings[::-1]) if k in d), None)
    if experts is None:  # the configs' defaults
        experts = {"mixtral": 8, "qwen2_moe": 60, "olmoe": 64}.get(model_type, 128)
    if not mixtral and experts == 0:
        return {}
    layers = d["num_hidden_layers"]
    if mixtral:
        moe_layers = [1] * layers
    else:
        # transformers' rule: layer i is sparse unless listed, when (i + 1) % step == 0.
        dense, step = set(d.get("mlp_only_layers") or ()), d.get("decoder_sparse_step", 1)
        moe_layers = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    k = d.get("num_experts_per_tok", 2 if mixtral else 4 if model_type == "qwen2_moe" else 8)
    # Mixtral's and OLMoE's experts are intermediate_size wide (they have no dense layer).
    expert_width = (
        "intermediate_size" if model_type in ("mixtral", "olmoe") else "moe_intermediate_size"
    )
    coeff = d.get("router_aux_loss_coef", 0.01 if model_type == "olmoe" else 0.001)
    fields = dict(
        num_experts=experts,
        moe_router_topk=k,
        moe_ffn_hidden_size=d[expert_width],
        moe_norm_topk_prob=mixtral or bool(d.get("norm_topk_prob", False)),
        moe_layer_freq=1 if all(moe_layers) else moe_layers,
        # The same balancing loss as transformers trains with (module doc): k times the
        # coefficient, and none where transformers adds none.
        moe_aux_loss_coeff=float(coeff) * k if d.get("output_router_logits") else 0.0,
    )
    if model_type == "qwen2_moe":
        shared = d.get("shared_expert_intermediate_size", 5632)
        if not shared:  # transformers would build a zero-width shared expert
            raise _unsupported(model_type, "shared_expert_intermediate_size", shared)
        fields.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    return fields


def _llama_like(d: dict, model_type: str) -> dict:
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    if model_type != "gemma" and d.get("hidden_act", "silu") != "silu":
        raise _unsupported(model_type, "hidden_act", d["hidden_act"])
    head_dim = d.get(
        "head_dim", {"qwen3": 128, "gemma": 256}.get(model_type)
    )  # Qwen3Config's, GemmaConfig's defaults
    base, scaling = _rotary(d, model_type)
    if model_type == "olmoe":
        if d.get("clip_qkv") is not None:
            raise _unsupported(model_type, "clip_qkv", d["clip_qkv"])
        if head_dim not in (None, hidden // heads):  # its q / k norms are hidden_size wide
            raise _unsupported(model_type, "head_dim", head_dim)
    if model_type == "qwen2":
        qkv_bias, proj_bias, mlp_bias = True, False, False
    elif model_type == "qwen2_moe":
        qkv_bias, proj_bias, mlp_bias = bool(d.get("qkv_bias", True)), False, False
    elif model_type == "mixtral":  # no bias options
        qkv_bias = proj_bias = mlp_bias = False
    else:
        qkv_bias = proj_bias = bool(d.get("attention_bias", False))
        mlp_bias = bool(d.get("mlp_bias", False))
    fields = dict(
        vocab_size=d["vocab_size"],
        num_layers=d["num_hidden_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        ffn_hidden_size=d["intermediate_size"],
        kv_channels=head_dim,
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        attention_dropout=float(d.get("attention_dropout", 0.0)),
        norm="rmsnorm",
        norm_eps=d.get("rms_norm_eps", 1e-6),
        activation="swiglu",
        position_embedding="rotary",
        rotary_base=base,
        rotary_scaling=scaling,
        sliding_window=_sliding_window(d, model_type, d["num_hidden_layers"]),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        bias=False,
        qkv_bias=qkv_bias,
        proj_bias=proj_bias,
        mlp_bias=mlp_bias,
        init_std=d.get("initializer_range", 0.02),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "olmoe"),
        qk_norm_scope="projection" if model_type == "olmoe" else "head",
    )
    if model_type in _MOE_FAMILIES:
        fields.update(_moe(d, model_type))
    return {**fields, **(_gemma(d) if model_type == "gemma" else {})}


def _gpt2(d: dict) -> dict:
    for option, ok in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if d.get(option, ok) != ok:
            raise _unsupported("gpt2", option, d[option])
    activation = d.get("activation_function", "gelu_new")
    if activation not in _GPT2_ACTIVATIONS:
        raise _unsupported("gpt2", "activation_function", activation)
    hidden = d.get("n_embd", 768)
    return dict(
        vocab_size=d.get("vocab_size", 50257),
        num_layers=d.get("n_layer", 12),
        hidden_size=hidden,
        num_attention_heads=d.get("n_head", 12),
        ffn_hidden_size=d.get("n_inner") or 4 * hidden,
        max_position_embeddings=d.get("n_positions", 1024),
        dropout=float(d.get("resid_pdrop", 0.1)),
        attention_dropout=float(d.get("attn_pdrop", 0.1)),
        norm="layernorm",
        norm_eps=d.get("layer_norm_epsilon", 1e-5),
        activation=_GPT2_ACTIVATIONS[activation],
        position_embedding="learned",
        tie_embeddings=bool(d.get("tie_word_embeddings", True)),
        bias=True,
        init_std=d.get("initializer_range", 0.02),
    )


def config_from_hf(source, **overrides) -> GPTConfig:
    """The GPTConfig of the Hugging Face model `source` (see `read_hf_config`); `overrides`
    replace fields afterwards (run-time choices such as sequence_parallel or dropout)."""
    d = read_hf_config(source)
    model_type = d.get("model_type")
    family = hf_family(model_type)
    try:
        fields = _gpt2(d) if family == "gpt2" else _llama_like(d, model_type)
    except KeyError as e:
        raise ValueError(f"tpcore: the {model_type} config has no {e.args[0]!r}") from None
    return GPTConfig(**{**fields, **overrides})


def _pick_moe_type(c: GPTConfig, preferred: str | None) -> str:
    """The MoE family whose architecture is exactly `c` (which has experts): qwen2_moe with
    a shared expert, qwen3_moe with q / k norms, else mixtral; a ValueError naming what
    that family lacks."""
    wrong = {
        "norm, activation and positions other than rmsnorm, swiglu and rotary": (
            c.norm,
            c.activation,
            c.position_embedding,
        )
        != ("rmsnorm", "swiglu", "rotary"),
        f"embedding_scale {c.embedding_scale}": c.embedding_scale is not None,
        f"moe_router_score_function {c.moe_router_score_function!r} (only softmax)": (
            c.moe_router_score_function != "softmax"
        ),
        "moe_router_topk_scaling_factor "
        f"{c.moe_router_topk_scaling_factor} (only 1)": c.moe_router_topk_scaling_factor != 1,
        "MLP biases (mlp_bias)": c.mlp_bias,
    }
    if c.qk_norm_scope == "projection":
        model_type = "olmoe"
        wrong.update(
            {
                "shared expert (moe_shared_expert_intermediate_size)": (
                    c.moe_shared_expert_intermediate_size is not None
                ),
                "q/k/v and output projection biases that differ (qkv_bias, proj_bias)": (
                    c.qkv_bias != c.proj_bias
                ),
                f"dense layers (moe_layer_freq {c.moe_layer_freq})": not all(
                    c.is_moe_layer(i) for i in range(c.num_layers)
                ),
                "head width other than hidden_size / num_attention_heads (kv_channels)": (
                    c.kv_channels is not None
                ),
                "sliding_window": c.sliding_window is not None,
            }
        )
    elif c.moe_shared_expert_intermediate_size is not None:
        model_type = "qwen2_moe"
        wrong.update(
            {
                "a shared expert without its gate (moe_shared_expert_gate)": (
                    not c.moe_shared_expert_gate
                ),
                "q / k norms (qk_norm)": c.qk_norm,
                "an output projection bias (proj_bias)": c.proj_bias,
            }
        )
    elif c.qk_norm:
        model_type = "qwen3_moe"
        wrong["q/k/v and output projection biases that differ (qkv_bias, proj_bias)"] = (
            c.qkv_bias != c.proj_bias
        )
    else:
        model_type = "mixtral"
        wrong.update(
            {
                "attention biases (qkv_bias, proj_bias)": c.qkv_bias or c.proj_bias,
                "top-k weights left unnormalised (moe_norm_topk_prob False; qwen3_moe has "
                "them, with qk_norm)": not c.moe_norm_topk_prob,
                "dense layers (moe_layer_freq "
                f"{c.moe_layer_freq}; qwen3_moe has them, with qk_norm)": not all(
                    c.is_moe_layer(i) for i in range(c.num_layers)
                ),
            }
        )
    if any(wrong.values()):
        raise ValueError(
            f"tpcore: GPTConfig -> {model_type} (the MoE family of this shape): it has no "
            f"{'; no '.join(w for w, bad in wrong.items() if bad)}"
        )
    return model_type


def _pick_model_type(c: GPTConfig, preferred: str | None) -> str:
    """The family whose architecture is exactly `c` (`preferred` when it fits); else a
    ValueError naming what fits none."""
    if c.num_experts is not None:
        return _pick_moe_type(c, preferred)
    if c.qk_norm_scope == "projection":
        raise ValueError(
            "tpcore: GPTConfig -> no dense Hugging Face family GPTModel exports has q / k norms "
            "over the whole projection (qk_norm_scope='projection'; OLMoE has them, with experts)"
        )
    if c.norm == "gemma_rmsnorm" and c.activation == "geglu" and c.position_embedding == "rotary":
        wrong = {
            "embedding_scale (must be sqrt(hidden_size))": c.embedding_scale is None
            or abs(c.embedding_scale - c.hidden_size**0.5) > 1e-6 * c.hidden_size**0.5,
            "q / k norms (qk_norm)": c.qk_norm,
            "a sliding_window": c.sliding_window is not None,
            "MLP biases (mlp_bias)": c.mlp_bias,
            "q/k/v and output projection biases that differ (qkv_bias, proj_bias)": c.qkv_bias
            != c.proj_bias,
        }
        if any(wrong.values()):
            raise ValueError(
                "tpcore: GPTConfig -> gemma: Gemma has "
                f"no {', '.join(w for w, bad in wrong.items() if bad)}"
            )
        return "gemma"
    if c.embedding_scale is not None:
        raise ValueError(
            "tpcore: GPTConfig -> only gemma scales its embeddings "
            f"(embedding_scale={c.embedding_scale}), and only with "
            "norm='gemma_rmsnorm', activation='geglu', position_embedding='rotary'"
        )
    if (
        c.norm == "layernorm"
        and c.activation in ("gelu", "gelu_exact")
        and c.position_embedding == "learned"
    ):
        if not (c.bias and c.qkv_bias and c.proj_bias and c.mlp_bias):
            raise ValueError(
                "tpcore: GPTConfig -> gpt2 needs biases "
                "everywhere (bias, qkv_bias, proj_bias, mlp_bias)"
            )
        if c.num_kv_heads != c.num_attention_heads:
            raise ValueError(
                "tpcore: GPTConfig -> gpt2 has no grouped-query "
                "attention (num_kv_heads must equal num_attention_heads)"
            )
        if c.sliding_window is not None:
            raise ValueError("tpcore: GPTConfig -> gpt2 has no sliding_window")
        if c.kv_channels is not None:  # (None is the default width, hidden / heads)
            raise ValueError(
                "tpcore: GPTConfig -> gpt2 has no head width other "
                "than hidden_size / num_attention_heads (kv_channels)"
            )
        if c.qk_norm:
            raise ValueError("tpcore: GPTConfig -> gpt2 has no q / k norms (qk_norm)")
        return "gpt2"
    if c.norm == "rmsnorm" and c.activation == "swiglu" and c.position_embedding == "rotary":
        if c.qk_norm:  # only Qwen3 has them
            if c.qkv_bias != c.proj_bias or c.mlp_bias:
                raise ValueError(
                    "tpcore: GPTConfig -> qwen3 (the family with qk_norm) has q/k/v/o biases alike "
                    f"and none in the MLP: qkv {c.qkv_bias}, proj {c.proj_bias}, mlp {c.mlp_bias}"
                )
            return "qwen3"
        only_qkv = c.qkv_bias and not (c.proj_bias or c.mlp_bias)
        fits = {
            "qwen2": only_qkv or not (c.qkv_bias or c.proj_bias or c.mlp_bias),
            "mistral": not (c.qkv_bias or c.proj_bias or c.mlp_bias),
            # transformers' LlamaConfig refuses a hidden size that the heads do not divide.
            "llama": c.qkv_bias == c.proj_bias
            and c.sliding_window is None
            and c.hidden_size % c.num_attention_heads == 0,
        }
        if preferred in fits and fits[preferred]:
            return preferred
        if only_qkv:
            return "qwen2"
        if fits["llama"]:  # (never with a sliding window: that is Mistral's)
            return "llama"
        if fits["mistral"]:
            return "mistral"
        raise ValueError(
            "tpcore: GPTConfig -> no Hugging Face family has these biases with this sliding "
            f"window and head layout: qkv {c.qkv_bias}, proj {c.proj_bias}, mlp {c.mlp_bias}, "
            f"sliding_window {c.sliding_window}, hidden_size {c.hidden_size} "
            f"{'' if c.hidden_size % c.num_attention_heads == 0 else 'not '}divisible by "
            f"num_attention_heads {c.num_attention_heads}"
        )
    raise ValueError(
        f"tpcore: GPTConfig -> no supported Hugging Face family has norm={c.norm!r}, "
        f"activation={c.activation!r}, position_embedding={c.position_embedding!r} "
        "(gpt2: layernorm + gelu + learned; llama / mistral / qwen2 / qwen3: rmsnorm "
        "+ swiglu + rotary; gemma: gemma_rmsnorm + geglu + rotary)"
    )


def config_to_hf(c: GPTConfig, base: dict | None = None) -> dict:
    """The `config.json` dict of `c`. `base` (the source model's config, e.g. with its token
    ids) is kept where it does not describe the architecture, which `c` overrides."""
    base = dict(base or {})
    model_type = _pick_model_type(c, base.get("model_type"))
    out = {
        k: v
        for k, v in base.items()
        if k
        not in (
            "rope_scaling",
            "rope_parameters",
            "rope_theta",
            "layer_types",
            "transformers_version",
            # MoE keys written below for MoE families, wrong for the others
            "num_experts",
            "num_local_experts",
            "mlp_only_layers",
            "decoder_sparse_step",
            "shared_expert_intermediate_size",
        )
    }
    out.update(
        model_type=model_type,
        architectures=[_ARCHITECTURES[model_type]],
        vocab_size=c.vocab_size,
        tie_word_embeddings=c.tie_embeddings,
        initializer_range=c.init_std,
    )
    if model_type == "gpt2":
        activation = {"gelu": "gelu_new", "gelu_exact": "gelu"}[c.activation]
        out.update(
            n_embd=c.hidden_size,
            n_layer=c.num_layers,
            n_head=c.num_attention_heads,
            n_inner=c.ffn_hidden_size,
            n_positions=c.max_position_embeddings,
            layer_norm_epsilon=c.norm_eps,
            activation_function=activation,
            resid_pdrop=c.dropout,
            embd_pdrop=c.dropout,
            attn_pdrop=c.attention_dropout,
        )
        return out
    scaling = c.rotary_scaling
    out.update(
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        intermediate_size=c.ffn_hidden_size,
        max_position_embeddings=c.max_position_embeddings,
        hidden_act="gelu_pytorch_tanh" if model_type == "gemma" else "silu",
        rms_norm_eps=c.norm_eps,
        attention_dropout=c.attention_dropout,
        # 4.x reads rope_theta + rope_scaling, 5.x rope_parameters (and converts the former).
        rope_theta=c.rotary_base,
        rope_scaling=dict(scaling) if scaling else None,
        rope_parameters={"rope_type": "default", **(scaling or {}), "rope_theta": c.rotary_base},
    )
    if model_type in _MOE_FAMILIES:
        out.update(_moe_to_hf(c, model_type, out))
    elif model_type == "llama":
        out.update(attention_bias=c.qkv_bias, mlp_bias=c.mlp_bias)
    elif model_type == "gemma":
        out.update(
            attention_bias=c.qkv_bias, hidden_activation="gelu_pytorch_tanh"
        )  # 4.x's name of hidden_act
    elif model_type == "mistral":
        out.update(sliding_window=c.sliding_window)
    else:  # qwen2, qwen3: the window (if any) on every layer
        if model_type == "qwen3":
            out.update(attention_bias=c.qkv_bias)
        window = c.sliding_window is not None
        out.update(
            use_sliding_window=window,
            sliding_window=c.sliding_window,
            max_window_layers=0 if window else c.num_layers,
            layer_types=["sliding_attention" if window else "full_attention"] * c.num_layers,
        )
    return out


def _moe_to_hf(c: GPTConfig, model_type: str, base: dict) -> dict:
    """The config.json keys of MoE family `model_type` for `c` (`base`: the keys so far)."""
    k = c.moe_router_topk
    out: dict = {"num_experts_per_tok": k}
    if c.moe_aux_loss_coeff > 0:  # k times transformers' coefficient (module doc)
        out.update(router_aux_loss_coef=c.moe_aux_loss_coeff / k, output_router_logits=True)
    else:  # no balancing loss: transformers adds none without the flag (its coefficient kept)
        out.update(output_router_logits=False)
    if model_type == "mixtral":
        out.update(
            num_local_experts=c.num_experts,
            intermediate_size=c.moe_ffn_hidden_size,
            sliding_window=c.sliding_window,
            router_jitter_noise=0.0,
        )
        return out
    if model_type == "olmoe":
        out.update(
            num_experts=c.num_experts,
            intermediate_size=c.moe_ffn_hidden_size,
            norm_topk_prob=c.moe_norm_topk_prob,
            attention_bias=c.qkv_bias,
            clip_qkv=None,
        )
        return out
    window = c.sliding_window is not None
    out.update(
        num_experts=c.num_experts,
        moe_intermediate_size=c.moe_ffn_hidden_size,
        norm_topk_prob=c.moe_norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(c.num_layers) if not c.is_moe_layer(i)],
        use_sliding_window=window,
    )
    if model_type == "qwen3_moe":  # the window, if any, on every layer
        out.update(attention_bias=c.qkv_bias, sliding_window=c.sliding_window)
    else:
        out.update(
            qkv_bias=c.qkv_bias,
            shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size,
            sliding_window=c.sliding_window if window else 0,  # transformers' "none"
            max_window_layers=c.num_layers if window else 0,
            layer_types=["sliding_attention" if window else "full_attention"] * c.num_layers,
        )
    return out
