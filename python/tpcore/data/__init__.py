"""Data pipeline: tokenizers, preprocessing to `.bin/.idx`, memory-mapped indexed datasets."""

import warnings

# `python -m tpcore.data.preprocess` (and .train_tokenizer) runs a module this package has
# already imported for its functions; runpy warns about exactly that, harmlessly, at every
# run. Only that message, only for this package:
warnings.filterwarnings(
    "ignore",
    message=r"'tpcore\.data\.\w+' found in sys\.modules after import of package 'tpcore\.data'",
    category=RuntimeWarning,
)

from .gpt_dataset import GPTDataset, split_documents  # noqa: E402
from .indexed_dataset import IndexedDataset, IndexedDatasetBuilder, best_token_dtype  # noqa: E402
from .preprocess import preprocess  # noqa: E402
from .sampler import micro_batch_indices  # noqa: E402
from .tokenizer import ByteTokenizer, JSONTokenizer, load_tokenizer  # noqa: E402
from .train_tokenizer import train_tokenizer  # noqa: E402

__all__ = [
    "GPTDataset",
    "split_documents",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "best_token_dtype",
    "preprocess",
    "micro_batch_indices",
    "ByteTokenizer",
    "JSONTokenizer",
    "load_tokenizer",
    "train_tokenizer",
]
