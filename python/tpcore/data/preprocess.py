"""Turn JSON lines or plain text into a tokenized `PREFIX.bin` / `PREFIX.idx` dataset.

    tpcore-preprocess --input corpus.jsonl --output-prefix data/corpus [--append-eod]
    python -m tpcore.data.preprocess --input notes.txt --format text --output-prefix data/notes

JSON lines: one document per line, text under `--json-key` (default "text"). Plain
text: one document per non-empty line. Input is UTF-8; a byte-order mark at the start of
the file is skipped. A malformed line (bad JSON, key missing or not
a string) is skipped and counted (lines without the key counted apart), or with
`--on-error fail` stops the run with its line number; a JSON input where no line has
the key fails naming the key and the file (a wrong `--json-key`, not an empty corpus).
The output appears only when the run succeeds (written to temporary files and renamed),
never half-written.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Iterator

from .indexed_dataset import IndexedDatasetBuilder, best_token_dtype, write_error
from .tokenizer import load_tokenizer

__all__ = ["preprocess", "main", "MalformedLine"]


class MalformedLine(ValueError):
    """A line of the input that is not a document; names the file and line number."""


class _MissingKey(ValueError):
    """A JSON object without the `--json-key` field; carries the keys it does have."""

    def __init__(self, key: str, keys: list[str]) -> None:
        super().__init__(f"no field {key!r} (the line has {keys[:8]})")
        self.keys = keys


def _document(line: str, fmt: str, key: str) -> str | None:
    """The text of one input line; None for a blank line; raises ValueError when malformed."""
    if fmt == "text":
        text = line.rstrip("\n")
        return text if text.strip() else None
    if not line.strip():
        return None
    record = json.loads(line)
    if isinstance(record, dict) and key not in record:
        raise _MissingKey(key, list(record))
    if not isinstance(record, dict) or not isinstance(record.get(key), str):
        raise ValueError(f"no string field {key!r}")
    return record[key]


_WORKER_TOKENIZER = None


def _init_worker(spec: str) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = load_tokenizer(spec)


# (line number, text, error): a document (text) or a malformed line (error); the error of a line
# without the key is its keys (a list), so the summary can show what the lines hold instead.
_Line = tuple[int, "str | None", "str | list[str] | None"]


def _encode(item: _Line) -> tuple[int, list[int] | None, str | list[str] | None]:
    number, text, error = item
    if text is None:
        return number, None, error
    return number, _WORKER_TOKENIZER.encode(text), None


def _parsed_lines(path: str, fmt: str, key: str) -> Iterator[_Line]:
    """(line number, text, error) for every document or malformed line of the input."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                # "utf-8-sig" on the first line: a byte-order mark (Windows editors write one)
                # is no part of the first document; json.loads would refuse the line for it.
                text = _document(raw.decode("utf-8-sig" if number == 1 else "utf-8"), fmt, key)
            except UnicodeDecodeError as e:
                yield number, None, f"not UTF-8 ({e.reason})"
                continue
            except _MissingKey as e:
                yield number, None, e.keys
                continue
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                yield number, None, str(e)
                continue
            if text is not None:
                yield number, text, None


def preprocess(
    input_path: str,
    output_prefix: str,
    *,
    tokenizer: str = "byte",
    fmt: str = "auto",
    json_key: str = "text",
    append_eod: bool = False,
    workers: int = 1,
    on_error: str = "skip",
    progress: bool = False,
) -> dict[str, int]:
    """Tokenize `input_path` into `output_prefix.{bin,idx}`; returns counts of the run
    (documents, tokens, skipped malformed lines, missing_key: those without `json_key`).
    Raises MalformedLine when no line is a document (none has `json_key`, all are malformed,
    or the input is empty) or, with on_error="fail", at the first malformed line; OSError
    naming the file when writing fails. Nothing is left after a failure."""
    if fmt == "auto":
        fmt = "jsonl" if input_path.endswith((".jsonl", ".json")) else "text"
    if fmt not in ("jsonl", "text") or on_error not in ("skip", "fail"):
        raise ValueError(f"tpcore: preprocess: bad format {fmt!r} or on_error {on_error!r}")
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"tpcore: preprocess: input {input_path} does not exist")
    tok = load_tokenizer(tokenizer)
    folder = os.path.dirname(os.path.abspath(output_prefix))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:  # read-only, or a file where a folder should be
        raise write_error(folder, e) from e
    counts = {"documents": 0, "tokens": 0, "skipped": 0, "missing_key": 0}
    keys_seen: list[str] = []  # of the first line without the key, for the error below
    first_error = ""  # of the first malformed line, for the error below
    lines = _parsed_lines(input_path, fmt, json_key)
    pool = (
        mp.get_context("spawn").Pool(workers, _init_worker, (tokenizer,)) if workers > 1 else None
    )
    encoded = pool.imap(_encode, lines, chunksize=256) if pool else map(_encode, lines)
    if pool is None:
        _init_worker(tokenizer)
    start = last = time.monotonic()
    try:
        with IndexedDatasetBuilder(output_prefix, best_token_dtype(tok.vocab_size)) as builder:
            for number, ids, error in encoded:
                if error is not None:
                    if isinstance(error, list):  # the keys of a line without the key
                        keys_seen = keys_seen or error
                        counts["missing_key"] += 1
                        error = f"no field {json_key!r} (the line has {error[:8]})"
                    if on_error == "fail":
                        raise MalformedLine(
                            f"tpcore: preprocess: {input_path}, line {number}: {error}"
                        )
                    first_error = first_error or f"line {number}: {error}"
                    counts["skipped"] += 1
                    continue
                if append_eod:
                    ids = ids + [tok.eod]
                builder.add_document(ids)
                counts["documents"] += 1
                counts["tokens"] += len(ids)
                if progress and time.monotonic() - last > 0.5:
                    last = time.monotonic()
                    rate = counts["documents"] / (last - start)
                    print(
                        f"\r{counts['documents']} documents, {counts['tokens']} tokens "
                        f"({rate:.0f} docs/s)",
                        end="",
                        file=sys.stderr,
                    )
            if counts["documents"] == 0 and counts["missing_key"]:
                # Raised inside the builder's block: it removes what it wrote.
                raise MalformedLine(
                    f"tpcore: preprocess: no line of {input_path} has a string field {json_key!r} "
                    f"(--json-key): {counts['missing_key']} lines lack it (the first has keys "
                    f"{keys_seen[:8]}), {counts['skipped'] - counts['missing_key']} other lines "
                    "are malformed"
                )
            if counts["documents"] == 0 and counts["skipped"]:
                raise MalformedLine(
                    f"tpcore: preprocess: no line of {input_path} is a document ({fmt}): "
                    f"{counts['skipped']} malformed lines (the first, {first_error}); is "
                    "--format right?"
                )
            if counts["documents"] == 0:
                raise MalformedLine(
                    f"tpcore: preprocess: {input_path} holds no document (it is empty or only "
                    "blank lines)"
                )
    finally:
        if pool is not None:
            pool.terminate()
    if progress:  # the final counts on the progress line (it showed the last update's)
        print(f"\r{counts['documents']} documents, {counts['tokens']} tokens", file=sys.stderr)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tpcore-preprocess", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--input", required=True, help="a .jsonl file (one JSON object per line) or a text file"
    )
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument(
        "--format",
        choices=["auto", "jsonl", "text"],
        default="auto",
        help="auto: by the file's ending",
    )
    parser.add_argument(
        "--json-key", default="text", help="field holding the text in each JSON line"
    )
    parser.add_argument(
        "--tokenizer",
        default="byte",
        help='"byte", the path of a tokenizer.json, or a Hugging Face model folder holding one',
    )
    parser.add_argument(
        "--append-eod",
        action="store_true",
        help="end every document with the end-of-document token",
    )
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    parser.add_argument(
        "--on-error",
        choices=["skip", "fail"],
        default="skip",
        help="malformed lines: skip and count, or stop",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    args = parser.parse_args(argv)
    try:
        counts = preprocess(
            args.input,
            args.output_prefix,
            tokenizer=args.tokenizer,
            fmt=args.format,
            json_key=args.json_key,
            append_eod=args.append_eod,
            workers=args.workers,
            on_error=args.on_error,
            progress=not args.quiet,
        )
    except (
        ValueError,
        OSError,
    ) as e:  # MalformedLine, a missing input, a full disk (named by the builder)
        print(e, file=sys.stderr)
        return 1
    missing = (
        f" ({counts['missing_key']} without the key {args.json_key!r})"
        if counts["missing_key"]
        else ""
    )
    print(
        f"{args.output_prefix}: {counts['documents']} documents, {counts['tokens']} tokens, "
        f"{counts['skipped']} malformed lines skipped{missing}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
