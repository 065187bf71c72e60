"""The tiny Hugging Face models the tests build (one per supported family, random weights,
saved with save_pretrained: no downloads), and loading them dense."""

from __future__ import annotations

import torch
import transformers

VOCAB = 97
_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=64,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    initializer_range=0.2,
)
_ENCODER = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=40,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    initializer_range=0.2,
)

# name -> (transformers class, config factory). Heads divide 4, so every TP size runs.
FAMILIES = {
    "gpt2": (
        "GPT2LMHeadModel",
        lambda: transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=64,
            bos_token_id=None,
            eos_token_id=None,
            initializer_range=0.2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
    ),  # tied head, Conv1D, fused c_attn
    "llama": (
        "LlamaForCausalLM",
        lambda: transformers.LlamaConfig(
            **_DECODER, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False
        ),
    ),  # GQA; TP=4 replicates KV
    "llama_tied": (
        "LlamaForCausalLM",
        lambda: transformers.LlamaConfig(
            **_DECODER, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True
        ),
    ),
    "mistral": (
        "MistralForCausalLM",
        lambda: transformers.MistralConfig(
            **_DECODER, num_attention_heads=8, num_key_value_heads=4, sliding_window=16
        ),
    ),
    "qwen2": (
        "Qwen2ForCausalLM",
        lambda: transformers.Qwen2Config(
            **_DECODER, num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False
        ),
    ),  # q/k/v biases
    # Llama's layout under other names' model types; each adds what its forward does differently.
    "qwen3": (
        "Qwen3ForCausalLM",
        lambda: transformers.Qwen3Config(
            **_DECODER, num_attention_heads=8, num_key_value_heads=4, head_dim=16
        ),
    ),  # q/k norms per head; head_dim != hidden / heads
    "gemma": (
        "GemmaForCausalLM",
        lambda: transformers.GemmaConfig(
            **_DECODER, num_attention_heads=4, num_key_value_heads=1, head_dim=16
        ),
    ),  # one KV head (replicated); scaled embeddings
    "gemma2": (
        "Gemma2ForCausalLM",
        lambda: transformers.Gemma2Config(
            **_DECODER,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=4,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            query_pre_attn_scalar=24,
        ),
    ),  # soft-capped logits
    "gemma3_text": (
        "Gemma3ForCausalLM",
        lambda: transformers.Gemma3TextConfig(
            **_DECODER, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4
        ),
    ),  # q/k norms, local + global layers
    "granite": (
        "GraniteForCausalLM",
        lambda: transformers.GraniteConfig(
            **_DECODER,
            num_attention_heads=8,
            num_key_value_heads=2,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=2.0,
        ),
    ),  # multipliers, scaled logits
    "olmo": (
        "OlmoForCausalLM",
        lambda: transformers.OlmoConfig(**_DECODER, num_attention_heads=4, clip_qkv=0.5),
    ),  # clipped q, k, v
    "smollm3": (
        "SmolLM3ForCausalLM",
        lambda: transformers.SmolLM3Config(
            **_DECODER, num_attention_heads=4, num_key_value_heads=2, no_rope_layer_interval=2
        ),
    ),  # layers without rotary
    "starcoder2": (
        "Starcoder2ForCausalLM",
        lambda: transformers.Starcoder2Config(
            **_DECODER,
            num_attention_heads=4,
            num_key_value_heads=2,
            residual_dropout=0.0,
            embedding_dropout=0.0,
        ),
    ),  # MLP c_fc / c_proj with biases
    "helium": (
        "HeliumForCausalLM",
        lambda: transformers.HeliumConfig(
            **_DECODER, num_attention_heads=4, num_key_value_heads=4, head_dim=16
        ),
    ),
    "ministral": (
        "MinistralForCausalLM",
        lambda: transformers.MinistralConfig(
            **_DECODER, num_attention_heads=8, num_key_value_heads=2, head_dim=8, sliding_window=4
        ),
    ),  # local + global layers
    "cohere": (
        "CohereForCausalLM",
        lambda: transformers.CohereConfig(
            **_DECODER,
            num_attention_heads=8,
            num_key_value_heads=2,
            use_qk_norm=True,
            logit_scale=0.5,
        ),
    ),  # per-head norm weights (KV copies at TP=4)
    "cohere2": (
        "Cohere2ForCausalLM",
        lambda: transformers.Cohere2Config(
            **_DECODER, num_attention_heads=4, num_key_value_heads=2, sliding_window=4
        ),
    ),  # local + global layers
    "olmo2": (
        "Olmo2ForCausalLM",
        lambda: transformers.Olmo2Config(**_DECODER, num_attention_heads=8, num_key_value_heads=2),
    ),  # q / k norms over all heads (KV copies at TP=4)
    "olmo3": (
        "Olmo3ForCausalLM",
        lambda: transformers.Olmo3Config(
            **_DECODER, num_attention_heads=4, num_key_value_heads=4, sliding_window=4
        ),
    ),  # the same norms; local + global layers
    "phi3": (
        "Phi3ForCausalLM",
        lambda: transformers.Phi3Config(
            **_DECODER, num_attention_heads=8, num_key_value_heads=2, partial_rotary_factor=0.5
        ),
    ),  # fused q|k|v (KV copies at TP=4), gate|up; Phi-4-mini's partial rotary
    # MoE: 4 experts, 2 per token; the load-balancing loss is on, so backward checks its
    # gradient too.
    "mixtral": (
        "MixtralForCausalLM",
        lambda: transformers.MixtralConfig(
            **_DECODER,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            output_router_logits=True,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        lambda: transformers.Qwen3MoeConfig(  # a dense MLP in layer 1
            **_DECODER,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            mlp_only_layers=[1],
            norm_topk_prob=True,
            output_router_logits=True,
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        lambda: transformers.Qwen2MoeConfig(  # a shared expert beside the routed ones
            **_DECODER,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=96,
            output_router_logits=True,
        ),
    ),
    "olmoe": (
        "OlmoeForCausalLM",
        lambda: transformers.OlmoeConfig(
            **_DECODER,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            output_router_logits=True,
        ),
    ),
    "gpt_neox": (
        "GPTNeoXForCausalLM",
        lambda: transformers.GPTNeoXConfig(**_DECODER, num_attention_heads=4, rotary_pct=0.5),
    ),  # QKV fused per head
    "bert": ("BertForMaskedLM", lambda: transformers.BertConfig(**_ENCODER)),
    "bert_model": ("BertModel", lambda: transformers.BertConfig(**_ENCODER)),  # pooled output
    "roberta": (
        "RobertaForMaskedLM",
        lambda: transformers.RobertaConfig(**_ENCODER, pad_token_id=1),
    ),
}
ENCODERS = {"bert", "bert_model", "roberta"}
MOE = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe"}
SPLIT_QK_NORMS = {
    "olmo2",
    "olmo3",
    "cohere",
    "olmoe",
}  # q / k norm weights cut by heads (not replicated)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def save_family(name: str, path, seed: int = 0) -> str:
    """Build family `name` with random weights (seeded) and save_pretrained it to `path`. Where
    the q / k norms' weights are split over the heads, they are drawn too (transformers
    initialises them to ones), so a rank loading the wrong heads' slice shows."""
    cls, make_config = FAMILIES[name]
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(make_config())
    with torch.no_grad():
        for n, p in model.named_parameters():
            if name in SPLIT_QK_NORMS and n.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return str(path)


def prompt(batch: int = 2, seq: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def padded_mask(ids: torch.Tensor) -> torch.Tensor:
    """The last row's tail is padding (right-padded encoder batch)."""
    mask = torch.ones_like(ids)
    mask[-1, ids.shape[1] // 2 :] = 0
    return mask


# transformers renamed from_pretrained's torch_dtype to dtype in 4.56.
DTYPE_KWARG = (
    "dtype"
    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (4, 56)
    else "torch_dtype"
)


def load_dense(path: str, cls: str, dtype: torch.dtype):
    return getattr(transformers, cls).from_pretrained(path, **{DTYPE_KWARG: dtype}).eval()
