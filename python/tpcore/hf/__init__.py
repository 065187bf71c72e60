"""One-call tensor parallelism for Hugging Face `transformers` models.

    tpcore.initialize_model_parallel(tensor_parallel_size=2)   # under torchrun, every rank
    model = tpcore.hf.from_pretrained("path/to/saved", dtype=torch.bfloat16)   # own slices only
    ids = tpcore.hf.generate(model, input_ids, max_new_tokens=50)  # LM head stays vocab-parallel
    # or, without torchrun, from a notebook or a plain script:
    with tpcore.hf.launch("path/to/saved", tensor_parallel_size=2) as model:
        ids = model.generate(input_ids, max_new_tokens=50)

`parallelize(model)` splits a model already in memory (a PEFT LoRA model with its adapters);
`save_pretrained(model, path)` writes a split model (or its adapters) for transformers (PEFT).
Families: see `supported_model_types()`; `register_policy(Policy(...))` adds one. Needs
`transformers` (`pip install tpcore[hf]`).

Two sub-packages: `tensor_parallel` (the one-call tensor parallelism of transformers models
above, whose names this package gives) and `gpt_bridge` (tpcore's own GPTModel to and from
Hugging Face folders: `config_from_hf`, `load_hf_weights`, `export_hf`, `checkpoint_to_hf`;
it needs no transformers).
"""

import importlib

_API = {
    "parallelize": "parallelize",
    "from_pretrained": "parallelize",
    "save_pretrained": "save",
    "load_adapter": "peft_lora",
    "generate": "generate",
    "sum_replicated_kv_grads": "grads",
    "launch": "launcher",
    "ParallelModel": "launcher",
    "WorkerError": "launcher",
    "VocabParallelLMHead": "lm_head",
    "local_logits": "lm_head",
    "find_lm_head": "lm_head",
    "make_plan": "plan",
    "Policy": "policy",
    "register_policy": "policy",
    "unregister_policy": "policy",
    "get_policy": "policy",
    "supported_model_types": "policy",
    "verify": "verify",
    "VerifyReport": "verify",
    "verify_main": "verify",
}


def __getattr__(name: str):
    # The one-call API loads on first use (and needs transformers then), so that
    # `tpcore.hf.gpt_bridge` imports without it.
    if name in _API:
        module = importlib.import_module(f".tensor_parallel.{_API[name]}", __name__)
        return getattr(module, "main" if name == "verify_main" else name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "parallelize",
    "from_pretrained",
    "save_pretrained",
    "load_adapter",
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
