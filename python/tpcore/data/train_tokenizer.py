"""Train a byte-level BPE `tokenizer.json` on JSON lines or plain text.

    tpcore-train-tokenizer --input corpus.jsonl [more.txt ...] --output tokenizer.json \\
        --vocab-size 4096

Inputs are read as by tpcore-preprocess (JSON lines: text under `--json-key`; plain
text: one document per non-empty line), but a malformed line stops the run with its
line number. Every byte is in the vocabulary, so any text encodes and decodes back
unchanged; "<|endoftext|>" is the end-of-document token. The output appears only
when training succeeds (written to a temporary file and renamed).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Iterator

from .._atomic import atomic_output
from .preprocess import _parsed_lines

__all__ = ["train_tokenizer", "main", "EOD_TOKEN"]

EOD_TOKEN = "<|endoftext|>"


def _documents(inputs: list[str], fmt: str, key: str, counts: dict[str, int]) -> Iterator[str]:
    for path in inputs:
        file_fmt = (
            ("jsonl" if path.endswith((".jsonl", ".json")) else "text") if fmt == "auto" else fmt
        )
        for number, text, error in _parsed_lines(path, file_fmt, key):
            if error is not None:
                raise ValueError(f"tpcore: train-tokenizer: {path}, line {number}: {error}")
            counts["documents"] += 1
            yield text


def train_tokenizer(
    inputs: list[str],
    output: str,
    *,
    vocab_size: int = 4096,
    fmt: str = "auto",
    json_key: str = "text",
    min_frequency: int = 2,
) -> str:
    """Train on the documents of `inputs` and write the tokenizer to `output`; returns `output`."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as e:  # an optional dependency
        raise ImportError(
            "tpcore: training a tokenizer needs the `tokenizers` package (pip install tokenizers)"
        ) from e
    if fmt not in ("auto", "jsonl", "text"):
        raise ValueError(f"tpcore: train-tokenizer: bad format {fmt!r}")
    if vocab_size < 258:  # 256 bytes + end-of-document + at least one merge
        raise ValueError(
            f"tpcore: train-tokenizer: vocab_size {vocab_size} is too small, it must be "
            "at least 258"
        )
    for path in inputs:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tpcore: train-tokenizer: input {path} does not exist")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    counts = {"documents": 0}
    tok.train_from_iterator(_documents(inputs, fmt, json_key, counts), trainer)
    if counts["documents"] == 0:
        raise ValueError(f"tpcore: train-tokenizer: no documents in {', '.join(inputs)}")
    with atomic_output(output) as tmp:
        tok.save(tmp)
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tpcore-train-tokenizer", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        help=".jsonl files (one JSON object per line) or text files",
    )
    parser.add_argument("--output", default="tokenizer.json", help="the tokenizer.json to write")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=4096,
        help="at most this many tokens (bytes and <|endoftext|> included)",
    )
    parser.add_argument(
        "--format",
        choices=["auto", "jsonl", "text"],
        default="auto",
        help="auto: by each file's ending",
    )
    parser.add_argument(
        "--json-key", default="text", help="field holding the text in each JSON line"
    )
    parser.add_argument(
        "--min-frequency", type=int, default=2, help="merge only pairs seen at least this often"
    )
    args = parser.parse_args(argv)
    try:
        path = train_tokenizer(
            args.input,
            args.output,
            vocab_size=args.vocab_size,
            fmt=args.format,
            json_key=args.json_key,
            min_frequency=args.min_frequency,
        )
    except (FileNotFoundError, ValueError, ImportError) as e:
        print(e, file=sys.stderr)
        return 1
    from .tokenizer import JSONTokenizer

    print(f"{path}: vocab size {JSONTokenizer(path).vocab_size}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
