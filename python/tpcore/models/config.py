"""GPT configuration shared by the tensor-parallel model and its dense reference."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .._validation import check_positive_ints

__all__ = ["GPTConfig"]

# Rotary scalings: "linear" divides every frequency by `factor` (positions interpolated);
# "llama3" divides only the low frequencies, blending in between (Llama 3.1's long context).
ROTARY_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}

_CHOICES = {
    "norm": ("layernorm", "rmsnorm", "gemma_rmsnorm"),
    "activation": ("gelu", "gelu_exact", "swiglu", "geglu"),
    "position_embedding": ("learned", "rotary"),
    "recompute": ("none", "selective", "full"),
    "moe_router_score_function": ("softmax", "sigmoid"),
    "moe_router_load_balancing_type": ("aux_loss", "none"),
    "moe_token_dispatcher_type": ("alltoall", "allgather"),
    "cp_comm_type": ("p2p", "a2a", "allgather"),
    "qk_norm_scope": ("head", "projection"),
}


@dataclass
class GPTConfig:
    """Shape and options of a GPT; validated on creation, and against a TP size by `check_tp`."""

    vocab_size: int
    """Real vocabulary size (the sharded table is padded, see make_vocab_size_divisible_by)."""
    num_layers: int
    """Number of transformer blocks."""
    hidden_size: int
    """Model width H."""
    num_attention_heads: int
    """Query heads; must divide H (unless kv_channels is given) and be divisible by the TP size."""
    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention (None: as many as query heads); fewer than
    the TP size are replicated (each rank keeps the head its queries use)."""
    ffn_hidden_size: int | None = None
    """MLP inner width (None: 4 * H)."""
    kv_channels: int | None = None
    """Width of each query / key / value head (Megatron's --kv-channels; HF's head_dim). None:
    H / num_attention_heads. Another value makes attention heads x kv_channels wide, so the
    QKV projection is [(heads + 2 kv_heads) x kv_channels, H] and the output projection
    [H, heads x kv_channels] (Mistral-Nemo: H 5120, 32 heads of 128)."""
    qk_norm: bool = False
    """Normalise each query and key head (over its kv_channels, with the model's norm) before
    the rotary embedding (Qwen3; Megatron's --qk-layernorm). The two norms' weights are
    shared by all heads and replicated over TP; backward sums their gradient over TP."""
    qk_norm_scope: str = "head"
    """What the q / k norms normalise: "head" (each head, as above) or "projection" (the whole
    q or k projection, every head at once; OLMoE's, RMSNorm only). Projection norms have one
    weight per feature, `[heads x kv_channels]` and `[kv_heads x kv_channels]`, split over
    TP with the heads; each rank's mean of squares is summed over TP (one all-reduce of
    `[s, b, 1]` per norm, forward and backward)."""
    max_position_embeddings: int = 1024
    """Longest sequence the model accepts."""
    dropout: float = 0.0
    """Dropout on the embedding output and after attention and MLP."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities."""
    norm: str = "layernorm"
    """"layernorm", "rmsnorm" or "gemma_rmsnorm" (`x / rms(x) * (1 + weight)` in float32,
    cast back after the weight: Gemma's; its weights start at zero)."""
    norm_eps: float = 1e-5
    """Epsilon of the norms."""
    activation: str = "gelu"
    """"gelu" (tanh approximation, GPT-2's "gelu_new"), "gelu_exact" (erf), "swiglu" (SiLU-gated,
    Llama) or "geglu" (tanh-approximated GeLU-gated, Gemma)."""
    position_embedding: str = "learned"
    """"learned" absolute positions or "rotary" (RoPE on queries and keys)."""
    rotary_base: float = 10000.0
    """Base of the rotary frequencies."""
    rotary_scaling: dict | None = None
    """Rotary frequency scaling: None, {"rope_type": "linear", "factor": f} or {"rope_type":
    "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}."""
    sliding_window: int | None = None
    """Attention window (Mistral): GPTModel attends to every earlier token, so it refuses
    sequences longer than this, where the window would change the result. None: no window."""
    tie_embeddings: bool = True
    """LM head shares the word-embedding weight."""
    embedding_scale: float | None = None
    """The word embeddings' lookup is multiplied by this, rounded to the model's dtype first
    (Gemma: sqrt(hidden_size)); None: not scaled. The LM head is not."""
    bias: bool = True
    """Biases in the linear layers and norms (RMSNorm has none); the default of the three below."""
    qkv_bias: bool | None = None
    """Biases on the query / key / value projection (None: `bias`; Qwen2 has only these)."""
    proj_bias: bool | None = None
    """Bias on the attention output projection (None: `bias`)."""
    mlp_bias: bool | None = None
    """Biases on the MLP's linear layers (None: `bias`)."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of weights."""
    make_vocab_size_divisible_by: int = 128
    """The sharded vocabulary is padded to a multiple of this times the TP size."""
    sequence_parallel: bool = False
    """Shard norm / dropout / residual activations along the sequence (Korthikanti et al. 2022)."""
    recompute: str = "none"
    """Activation recomputation: "none", "selective" (attention core) or "full" (whole blocks)."""
    fused_lm_head_loss: bool = False
    """Compute the LM head and the loss chunk by chunk, never materialising the logits."""
    cp_comm_type: str = "p2p"
    """How attention crosses the context-parallel ranks (docs/context_parallel.md): "p2p"
    (ring attention), "a2a" (Ulysses all-to-all; query heads per TP rank divisible by CP) or
    "allgather" (keys and values gathered). Only used at context-parallel size > 1."""
    # Mixture of experts (Megatron-Core's names; docs/moe.md). None: every MLP is dense.
    num_experts: int | None = None
    """Experts of each MoE layer (None: no MoE layer)."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int | None = None
    """Inner width of each expert (None: ffn_hidden_size)."""
    moe_shared_expert_intermediate_size: int | None = None
    """Inner width of the shared expert every token also goes through (Qwen2-MoE, DeepSeek);
    None: none."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(x . w), w `[1, H]` (Qwen2-MoE)."""
    moe_layer_freq: int | list[int] = 1
    """Which layers are MoE: every n-th from the first (n), or one 0/1 per layer (e.g. dense
    first layers: [0, 1, 1, ...])."""
    moe_router_score_function: str = "softmax"
    """"softmax" (Mixtral, Qwen-MoE, OLMoE) or "sigmoid" (DeepSeek-V3)."""
    moe_norm_topk_prob: bool = True
    """Rescale each token's k routing weights to sum to one (Mixtral, Qwen3-MoE; Qwen2-MoE
    and OLMoE do not)."""
    moe_router_topk_scaling_factor: float = 1.0
    """Multiplies the routing weights (DeepSeek-V3's routed_scaling_factor)."""
    moe_router_load_balancing_type: str = "aux_loss"
    """"aux_loss" (Switch Transformer's, with moe_aux_loss_coeff) or "none"."""
    moe_aux_loss_coeff: float = 0.0
    """Coefficient of the load-balancing loss."""
    moe_z_loss_coeff: float = 0.0
    """Coefficient of the router z-loss (ST-MoE)."""
    moe_expert_capacity_factor: float | None = None
    """Each expert takes at most ceil(tokens * k / experts * factor) of the tokens one rank
    routes, those of largest weight; the rest of their routes are dropped. None: dropless."""
    moe_token_dispatcher_type: str = "alltoall"
    """"alltoall" (routed tokens only travel) or "allgather" (every token gathered)."""
    moe_router_enable_expert_bias: bool = False
    """DeepSeek-V3's auxiliary-loss-free balancing (sigmoid scores): a per-expert bias added to
    the scores for choosing, moved towards the mean load after every step by
    moe_router_bias_update_rate."""
    moe_router_bias_update_rate: float = 1e-3
    """How far each expert's balancing bias moves per step."""
    moe_grouped_gemm: bool = True
    """Run the local experts through one grouped GEMM (torch._grouped_mm where it runs);
    False: a loop over the experts."""

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        for name in (
            "qkv_bias",
            "proj_bias",
            "mlp_bias",
        ):  # resolved, so checkpoints record what was built
            if getattr(self, name) is None:
                setattr(self, name, self.bias)
        check_positive_ints(
            "GPTConfig",
            vocab_size=self.vocab_size,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_kv_heads=self.num_kv_heads,
            ffn_hidden_size=self.ffn_hidden_size,
            max_position_embeddings=self.max_position_embeddings,
            make_vocab_size_divisible_by=self.make_vocab_size_divisible_by,
        )
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"tpcore: GPTConfig: {name} must be one "
                    f"of {allowed}, got {getattr(self, name)!r}"
                )
        if self.kv_channels is not None:
            check_positive_ints("GPTConfig", kv_channels=self.kv_channels)
            if self.kv_channels * self.num_attention_heads == self.hidden_size:
                self.kv_channels = None  # the default width: one spelling, so configs compare equal
        elif self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"tpcore: GPTConfig: hidden_size {self.hidden_size} is not "
                f"divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"tpcore: GPTConfig: num_attention_heads {self.num_attention_heads} "
                f"is not divisible by num_kv_heads {self.num_kv_heads}"
            )
        if self.position_embedding == "rotary" and self.head_dim % 2:
            raise ValueError(
                f"tpcore: GPTConfig: rotary embeddings need an even head dim, got {self.head_dim}"
            )
        if self.qk_norm_scope == "projection" and not (self.qk_norm and self.norm == "rmsnorm"):
            raise ValueError(
                "tpcore: GPTConfig: qk_norm_scope='projection' needs qk_norm=True and "
                f"norm='rmsnorm', got qk_norm={self.qk_norm}, norm={self.norm!r}"
            )
        if self.sliding_window is not None:
            check_positive_ints("GPTConfig", sliding_window=self.sliding_window)
        self._check_rotary_scaling()
        self._check_moe()
        scale = self.embedding_scale
        if scale is not None and not (
            isinstance(scale, (int, float)) and not isinstance(scale, bool) and 0 < scale < math.inf
        ):
            raise ValueError(
                "tpcore: GPTConfig: embedding_scale must be None "
                f"or a positive finite number, got {scale!r}"
            )
        for name in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(
                    f"tpcore: GPTConfig: {name} must be in [0, 1), got {getattr(self, name)}"
                )

    def _check_rotary_scaling(self) -> None:
        scaling = self.rotary_scaling
        if scaling is None:
            return
        kind = scaling.get("rope_type") if isinstance(scaling, dict) else None
        if kind not in ROTARY_SCALING_KEYS:
            raise ValueError(
                "tpcore: GPTConfig: rotary_scaling must be None or a dict whose "
                f"rope_type is one of {sorted(ROTARY_SCALING_KEYS)}, got {scaling!r}"
            )
        if self.position_embedding != "rotary":
            raise ValueError("tpcore: GPTConfig: rotary_scaling needs position_embedding='rotary'")
        wanted = ROTARY_SCALING_KEYS[kind]
        missing, extra = (
            [k for k in wanted if k not in scaling],
            sorted(set(scaling) - set(wanted) - {"rope_type"}),
        )
        if missing or extra:
            raise ValueError(
                f"tpcore: GPTConfig: rotary_scaling {kind!r} needs exactly "
                f"the keys {list(wanted)} (missing {missing}, unknown {extra})"
            )
        if not all(
            isinstance(scaling[k], (int, float))
            and not isinstance(scaling[k], bool)
            and scaling[k] > 0
            for k in wanted
        ):
            raise ValueError(
                "tpcore: GPTConfig: rotary_scaling values "
                f"must be positive numbers, got {scaling!r}"
            )
        if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
            raise ValueError(
                "tpcore: GPTConfig: rotary_scaling llama3 needs "
                f"high_freq_factor > low_freq_factor, got {scaling!r}"
            )

    def _check_moe(self) -> None:
        def fail(what: str) -> None:
            raise ValueError(f"tpcore: GPTConfig: {what}")

        if self.num_experts is None:
            # A MoE option without experts is a mistake, not a no-op.
            changed = [
                f.name
                for f in dataclasses.fields(self)
                if f.name.startswith("moe_") and getattr(self, f.name) != f.default
            ]
            if changed:
                fail(f"{', '.join(changed)} set without num_experts")
            return
        check_positive_ints(
            "GPTConfig", num_experts=self.num_experts, moe_router_topk=self.moe_router_topk
        )
        if self.moe_router_topk > self.num_experts:
            fail(
                f"moe_router_topk ({self.moe_router_topk}) exceeds num_experts ({self.num_experts})"
            )
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        check_positive_ints("GPTConfig", moe_ffn_hidden_size=self.moe_ffn_hidden_size)
        if self.moe_shared_expert_intermediate_size is not None:
            check_positive_ints(
                "GPTConfig",
                moe_shared_expert_intermediate_size=self.moe_shared_expert_intermediate_size,
            )
        elif self.moe_shared_expert_gate:
            fail("moe_shared_expert_gate needs moe_shared_expert_intermediate_size")
        freq = self.moe_layer_freq
        if isinstance(freq, (list, tuple)):
            if len(freq) != self.num_layers or any(f not in (0, 1) for f in freq):
                fail(
                    f"moe_layer_freq as a list needs one 0 or 1 per layer ({self.num_layers}), "
                    f"got {list(freq)}"
                )
            self.moe_layer_freq = [int(f) for f in freq]
        else:
            check_positive_ints("GPTConfig", moe_layer_freq=freq)
        for name in (
            "moe_router_topk_scaling_factor",
            "moe_aux_loss_coeff",
            "moe_z_loss_coeff",
        ):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                fail(f"{name} must be a finite number >= 0, got {value!r}")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            fail("moe_router_enable_expert_bias needs moe_router_score_function 'sigmoid'")
        if not (
            isinstance(self.moe_router_bias_update_rate, (int, float))
            and self.moe_router_bias_update_rate > 0
        ):
            fail(
                f"moe_router_bias_update_rate must be > 0, got {self.moe_router_bias_update_rate!r}"
            )
        factor = self.moe_expert_capacity_factor
        if factor is not None and not (isinstance(factor, (int, float)) and factor > 0):
            fail(f"moe_expert_capacity_factor must be > 0 or None, got {factor!r}")

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` (0-based, global) has experts instead of a dense MLP."""
        if self.num_experts is None:
            return False
        freq = self.moe_layer_freq
        return bool(freq[index]) if isinstance(freq, list) else index % freq == 0

    def check_ep(self, ep: int) -> None:
        """Raise a ValueError unless the experts split over `ep` expert-parallel ranks."""
        if ep > 1 and self.num_experts is None:
            raise ValueError(
                f"tpcore: GPTConfig: expert-parallel size {ep} for a model without experts"
            )
        if self.num_experts is not None and self.num_experts % ep:
            raise ValueError(
                f"tpcore: GPTConfig: num_experts ({self.num_experts}) is not divisible by the "
                f"expert-parallel size ({ep})"
            )

    @property
    def gated_mlp(self) -> bool:
        """fc1 holds [gate; up] (SwiGLU, GeGLU): twice ffn_hidden_size rows."""
        return self.activation in ("swiglu", "geglu")

    @property
    def head_dim(self) -> int:
        """Width of one attention head: kv_channels, else H / num_attention_heads."""
        return (
            self.kv_channels
            if self.kv_channels is not None
            else self.hidden_size // self.num_attention_heads
        )

    def check_cp(self, cp: int, tp: int = 1) -> None:
        """Raise a ValueError naming what context parallelism over `cp` ranks (with `tp`
        tensor-parallel ranks) does not support in this config."""
        if cp == 1:
            return
        if self.attention_dropout > 0:
            raise ValueError(
                f"tpcore: GPTConfig: attention_dropout ({self.attention_dropout}) with "
                f"context-parallel size {cp}: dropout on attention probabilities split over "
                "ranks is not implemented; set attention_dropout to 0"
            )
        heads = self.num_attention_heads // tp
        if self.cp_comm_type == "a2a" and heads % cp:
            raise ValueError(
                f"tpcore: GPTConfig: cp_comm_type 'a2a' splits each tensor-parallel rank's "
                f"{heads} attention heads over the context-parallel size {cp}: "
                "num_attention_heads must be divisible by tensor-parallel size x "
                "context-parallel size (or use p2p / allgather)"
            )

    def check_tp(self, tp: int) -> None:
        """Raise a ValueError naming what does not split over `tp` tensor-parallel ranks.
        Fewer KV heads than ranks is fine when they divide `tp`: each rank then holds a copy
        of the KV head its query heads use, as `tpcore.hf` does (see `models/gqa.py`)."""
        for name in ("num_attention_heads", "ffn_hidden_size"):
            if getattr(self, name) % tp:
                raise ValueError(
                    f"tpcore: GPTConfig: {name} ({getattr(self, name)}) "
                    f"is not divisible by the tensor-parallel size ({tp})"
                )
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise ValueError(
                f"tpcore: GPTConfig: num_kv_heads ({self.num_kv_heads}) and the tensor-parallel "
                f"size ({tp}): one must divide the other (KV heads are split when TP divides "
                "them, replicated over TP / num_kv_heads ranks when they divide TP)"
            )
