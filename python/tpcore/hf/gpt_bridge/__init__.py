"""tpcore's GPTModel to and from Hugging Face folders, without transformers:

    config = config_from_hf("path/to/llama")        # GPTConfig of a config.json
    model = GPTModel(config); load_hf_weights(model, "path/to/llama")   # each rank its slices
    export_hf(model, "out/")                         # a running model (a collective)
    checkpoint_to_hf("checkpoints/run", "out/")      # a checkpoint, in one process

Families: GPT-2, Llama, Mistral, Qwen2/3, Gemma, and the mixtures of experts Mixtral,
Qwen2-MoE and Qwen3-MoE (`config.SUPPORTED_MODEL_TYPES`; experts split over the
expert-parallel group, read and written per rank like the TP slices).
"""

from .checkpoint import checkpoint_to_hf
from .config import SUPPORTED_MODEL_TYPES, config_from_hf, config_to_hf, read_hf_config
from .export import export_hf
from .weights import load_hf_weights

__all__ = [
    "config_from_hf",
    "config_to_hf",
    "read_hf_config",
    "SUPPORTED_MODEL_TYPES",
    "load_hf_weights",
    "export_hf",
    "checkpoint_to_hf",
]
