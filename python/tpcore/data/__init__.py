"""Data pipeline: tokenizers, preprocessing to `.bin/.idx`, memory-mapped indexed datasets."""

from .gpt_dataset import GPTDataset, split_documents
from .indexed_dataset import IndexedDataset, IndexedDatasetBuilder, best_token_dtype
from .preprocess import preprocess
from .sampler import micro_batch_indices
from .tokenizer import ByteTokenizer, JSONTokenizer, load_tokenizer
from .train_tokenizer import train_tokenizer

__all__ = ["GPTDataset", "split_documents", "IndexedDataset", "IndexedDatasetBuilder", "best_token_dtype", "preprocess", "micro_batch_indices", "ByteTokenizer", "JSONTokenizer", "load_tokenizer", "train_tokenizer"]
