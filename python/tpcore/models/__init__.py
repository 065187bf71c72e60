"""GPT models: the tensor-parallel GPTModel, its plain-PyTorch reference, generation.
(To and from Hugging Face folders: `tpcore.hf.gpt_bridge`.)"""

from .config import GPTConfig
from .generate import generate
from .gpt import GPTModel, finalize_sequence_parallel_grads
from .reference_gpt import ReferenceGPT

__all__ = [
    "GPTConfig",
    "GPTModel",
    "ReferenceGPT",
    "finalize_sequence_parallel_grads",
    "generate",
]
