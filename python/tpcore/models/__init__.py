"""GPT models: the tensor-parallel GPTModel, its plain-PyTorch reference, and the Hugging
Face bridge (GPTConfig.from_hf / to_hf, load_hf_weights, export_hf)."""

from .config import GPTConfig
from .generate import generate
from .gpt import GPTModel, finalize_sequence_parallel_grads
from .hf_export import export_hf
from .hf_weights import load_hf_weights
from .reference_gpt import ReferenceGPT

__all__ = [
    "GPTConfig",
    "GPTModel",
    "ReferenceGPT",
    "finalize_sequence_parallel_grads",
    "generate",
    "load_hf_weights",
    "export_hf",
]
