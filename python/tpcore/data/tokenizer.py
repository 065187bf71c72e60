"""Tokenizers: a byte-level one that needs no files, and any `tokenizer.json`."""

from __future__ import annotations

import os
from typing import Protocol

__all__ = ["Tokenizer", "ByteTokenizer", "JSONTokenizer", "load_tokenizer"]


class Tokenizer(Protocol):
    vocab_size: int
    eod: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, end-of-document 256 (vocab_size 257)."""

    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class JSONTokenizer:
    """A `tokenizer.json` of the `tokenizers` library (BPE or any other model)."""

    def __init__(self, path: str, eod_token: str = "<|endoftext|>") -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as e:  # an optional dependency
            raise ImportError("tpcore: loading a tokenizer.json needs the `tokenizers` package (pip install tokenizers)") from e
        self.path = path
        # The tokenizers library's errors name no file ("No such file or directory (os error 2)",
        # "expected value at line 1 column 1"): check and name it here.
        if os.path.isdir(path):
            raise IsADirectoryError(f"tpcore: --tokenizer {path} is a directory; pass the tokenizer.json inside it (or \"byte\")")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tpcore: --tokenizer {path} does not exist (\"byte\" or the path of a tokenizer.json)")
        try:
            self._tok = HFTokenizer.from_file(path)
        except Exception as e:  # the library raises a bare Exception for any unreadable file
            raise ValueError(f"tpcore: --tokenizer {path} is not a tokenizer.json of the tokenizers library ({e})") from e
        self.vocab_size = self._tok.get_vocab_size()
        eod = self._tok.token_to_id(eod_token)
        if eod is None:
            raise ValueError(f"tpcore: {path}: the tokenizer has no end-of-document token {eod_token!r}")
        self.eod = eod

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids))


def load_tokenizer(spec: str) -> Tokenizer:
    """"byte" for the byte-level tokenizer, else the path of a `tokenizer.json`."""
    if spec == "byte":
        return ByteTokenizer()
    return JSONTokenizer(spec)
