"""Tokenizers: a byte-level one that needs no files, and any `tokenizer.json` (alone or in a
Hugging Face folder)."""

from __future__ import annotations

import json
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


def _folder_eod(folder: str) -> tuple[str | None, int | None]:
    """The end-of-document token of a Hugging Face model folder: the tokenizer's
    `eos_token` (tokenizer_config.json), else the model's `eos_token_id` (config.json)."""

    def read(name: str) -> dict:
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                value = json.load(f)
            return value if isinstance(value, dict) else {}
        except (OSError, ValueError):
            return {}

    eos = read("tokenizer_config.json").get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos, str):
        return eos, None
    eos_id = read("config.json").get("eos_token_id")
    eos_id = eos_id[0] if isinstance(eos_id, list) and eos_id else eos_id
    return None, eos_id if isinstance(eos_id, int) else None


class JSONTokenizer:
    """A `tokenizer.json` of the `tokenizers` library (BPE or any other model), or a Hugging
    Face model folder holding one (its end-of-document token is the folder's eos token)."""

    def __init__(self, path: str, eod_token: str = "<|endoftext|>") -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as e:  # an optional dependency
            raise ImportError(
                "tpcore: loading a tokenizer.json needs the `tokenizers` package (pip "
                "install tokenizers)"
            ) from e
        self.path, eod_id = path, None
        # The tokenizers library's errors name no file ("No such file or directory (os error 2)",
        # "expected value at line 1 column 1"): check and name it here.
        if os.path.isdir(path):
            if not os.path.isfile(os.path.join(path, "tokenizer.json")):
                raise IsADirectoryError(
                    f"tpcore: --tokenizer {path} is a directory without a tokenizer.json (a "
                    "Hugging Face folder saved with a fast tokenizer has one)"
                )
            found, eod_id = _folder_eod(path)
            eod_token = found or eod_token
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f'tpcore: --tokenizer {path} does not exist ("byte" or the path of a '
                "tokenizer.json)"
            )
        try:
            self._tok = HFTokenizer.from_file(path)
        except Exception as e:  # the library raises a bare Exception for any unreadable file
            raise ValueError(
                f"tpcore: --tokenizer {path} is not a tokenizer.json of the tokenizers "
                f"library ({e})"
            ) from e
        self.vocab_size = self._tok.get_vocab_size()
        eod = self._tok.token_to_id(eod_token) if eod_id is None else eod_id
        if eod is None:
            raise ValueError(
                f"tpcore: {self.path}: the tokenizer has no end-of-document token {eod_token!r}"
            )
        self.eod = eod

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids))


def load_tokenizer(spec: str) -> Tokenizer:
    """ "byte" for the byte-level tokenizer, else the path of a `tokenizer.json` or of a
    Hugging Face model folder holding one."""
    if spec == "byte":
        return ByteTokenizer()
    return JSONTokenizer(spec)
