"""GPT configuration shared by the tensor-parallel model and its dense reference."""

from __future__ import annotations

from dataclasses import dataclass

from .._validation import check_positive_ints

__all__ = ["GPTConfig"]

_CHOICES = {
    "norm": ("layernorm", "rmsnorm"),
    "activation": ("gelu", "swiglu"),
    "position_embedding": ("learned", "rotary"),
    "recompute": ("none", "selective", "full"),
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
    """Query heads; must divide H and be divisible by the TP size."""
    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention (None: as many as query heads)."""
    ffn_hidden_size: int | None = None
    """MLP inner width (None: 4 * H)."""
    max_position_embeddings: int = 1024
    """Longest sequence the model accepts."""
    dropout: float = 0.0
    """Dropout on the embedding output and after attention and MLP."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities."""
    norm: str = "layernorm"
    """"layernorm" or "rmsnorm"."""
    norm_eps: float = 1e-5
    """Epsilon of the norms."""
    activation: str = "gelu"
    """"gelu" (tanh approximation as GPT-2) or "swiglu"."""
    position_embedding: str = "learned"
    """"learned" absolute positions or "rotary" (RoPE on queries and keys)."""
    rotary_base: float = 10000.0
    """Base of the rotary frequencies."""
    tie_embeddings: bool = True
    """LM head shares the word-embedding weight."""
    bias: bool = True
    """Biases in the linear layers and norms (RMSNorm has none)."""
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

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
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
                raise ValueError(f"tpcore: GPTConfig: {name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"tpcore: GPTConfig: hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"tpcore: GPTConfig: num_attention_heads {self.num_attention_heads} is not divisible by num_kv_heads {self.num_kv_heads}"
            )
        if self.position_embedding == "rotary" and self.head_dim % 2:
            raise ValueError(f"tpcore: GPTConfig: rotary embeddings need an even head dim, got {self.head_dim}")
        for name in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"tpcore: GPTConfig: {name} must be in [0, 1), got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def check_tp(self, tp: int) -> None:
        """Raise a ValueError naming what does not split over `tp` tensor-parallel ranks."""
        for name in ("num_attention_heads", "num_kv_heads", "ffn_hidden_size"):
            if getattr(self, name) % tp:
                raise ValueError(
                    f"tpcore: GPTConfig: {name} ({getattr(self, name)}) is not divisible by the tensor-parallel size ({tp})"
                )
