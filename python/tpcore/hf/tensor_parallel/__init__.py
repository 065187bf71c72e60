"""One-call tensor parallelism of Hugging Face `transformers` models (`tpcore.hf.parallelize`,
`from_pretrained`, `generate`, `launch`, `verify`): the policies of each family, the plan of
what to split, the split itself, weights read slice by slice, the vocab-parallel LM head,
gradient sums of replicated tensors, mixtures of experts."""

import importlib.util

if importlib.util.find_spec("transformers") is None:
    raise ImportError("tpcore.hf needs the transformers package: pip install 'tpcore[hf]'")
