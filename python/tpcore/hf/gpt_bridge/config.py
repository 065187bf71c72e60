"""GPTConfig <-> Hugging Face `config.json` for the families GPTModel computes exactly.

    # a folder, its config.json, a dict or a transformers config
    config = config_from_hf("path/to/llama")
    json.dump(config_to_hf(config), open("config.json", "w"))

Families: `gpt2` (LayerNorm, tanh or erf GeLU, learned positions, biases everywhere) and the
Llama shape `llama`, `mistral`, `qwen2`, `qwen3`, `gemma` (RMSNorm, SwiGLU, rotary, GQA;
Qwen2 has q/k/v biases only, Qwen3 q/k norms; Gemma (1 + weight) norms, GeGLU, embeddings
scaled by sqrt(hidden) and a tied head; head_dim other than hidden / heads is kv_channels).
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

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma")
_LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "gemma")
_ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
}
# Why the families transformers has and GPTModel lacks are refused (the first thing each needs).
_MISSING = {
    "gpt_neox": "GPT-NeoX's parallel residual and partial rotary embeddings",
    "gptj": "GPT-J's parallel residual and interleaved partial rotary embeddings",
    "falcon": "Falcon's parallel attention / MLP",
    "phi": "Phi's parallel residual and partial rotary embeddings",
    "gemma2": "Gemma 2's logit soft-capping and extra norms around attention and MLP",
    "mixtral": "Mixtral's mixture-of-experts MLP",
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
    """ "gpt2" or "llama" (the parameter names and layout: Mistral, Qwen2 and Qwen3 share Llama's);
    a ValueError naming an unsupported type and why."""
    if model_type == "gpt2":
        return "gpt2"
    if model_type in _LLAMA_LIKE:
        return "llama"
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


def _llama_like(d: dict, model_type: str) -> dict:
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    if model_type != "gemma" and d.get("hidden_act", "silu") != "silu":
        raise _unsupported(model_type, "hidden_act", d["hidden_act"])
    head_dim = d.get(
        "head_dim", {"qwen3": 128, "gemma": 256}.get(model_type)
    )  # Qwen3Config's, GemmaConfig's defaults
    base, scaling = _rotary(d, model_type)
    if model_type == "qwen2":
        qkv_bias, proj_bias, mlp_bias = True, False, False
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
        qk_norm=model_type == "qwen3",
    )
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


def _pick_model_type(c: GPTConfig, preferred: str | None) -> str:
    """The family whose architecture is exactly `c` (`preferred` when it fits); else a
    ValueError naming what fits none."""
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
    if model_type == "llama":
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
