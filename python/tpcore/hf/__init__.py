"""One-call tensor parallelism for Hugging Face `transformers` models.

    tpcore.initialize_model_parallel(tensor_parallel_size=2)   # under torchrun, every rank
    model = tpcore.hf.from_pretrained("path/to/saved", dtype=torch.bfloat16)   # own slices only
    ids = tpcore.hf.generate(model, input_ids, max_new_tokens=50)  # LM head stays vocab-parallel
    # or, without torchrun, from a notebook or a plain script:
    with tpcore.hf.launch("path/to/saved", tensor_parallel_size=2) as model:
        ids = model.generate(input_ids, max_new_tokens=50)

`parallelize(model)` splits a model already in memory. Families: see
`supported_model_types()`; `register_policy(Policy(...))` adds one. Needs `transformers`
(`pip install tpcore[hf]`).
"""

import importlib.util

if importlib.util.find_spec("transformers") is None:
    raise ImportError("tpcore.hf needs the transformers package: pip install 'tpcore[hf]'")

from .convert import from_pretrained, parallelize
from .generate import generate
from .grads import sum_replicated_kv_grads
from .launcher import ParallelModel, WorkerError, launch
from .lm_head import VocabParallelLMHead, find_lm_head, local_logits
from .plan import make_plan
from .policy import Policy, get_policy, register_policy, supported_model_types, unregister_policy
from .verify import VerifyReport, verify
from .verify import main as verify_main

__all__ = [
    "parallelize",
    "from_pretrained",
    "generate",
    "sum_replicated_kv_grads",
    "launch",
    "ParallelModel",
    "WorkerError",
    "VocabParallelLMHead",
    "local_logits",
    "find_lm_head",
    "make_plan",
    "Policy",
    "register_policy",
    "unregister_policy",
    "get_policy",
    "supported_model_types",
    "verify",
    "VerifyReport",
    "verify_main",
]
