"""Turn the Debian `fortunes` collection into JSON lines: a small default pretraining corpus.

    python examples/prepare_fortunes.py [--source-dir /usr/share/games/fortunes]
                                        [--output data/fortunes.jsonl]

Each fortune file holds entries separated by lines that are exactly "%"; every
non-empty entry (stripped) becomes one line {"text": ...}. Files are read in sorted
order, so the output is the same on every run; `*.dat` indexes, `*.u8` links,
symlinks and subdirectories (such as the offensive `off/`) are skipped. Bytes that
are not UTF-8 (a few files are latin-1) become U+FFFD. The output appears only when
complete (written to a temporary file and renamed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tpcore._atomic import atomic_output

DEFAULT_SOURCE = "/usr/share/games/fortunes"


def fortune_files(source_dir: str) -> list[str]:
    """The fortune files of `source_dir`, sorted by name: regular files only, no indexes or
    links."""
    with os.scandir(source_dir) as entries:
        return sorted(
            e.path
            for e in entries
            if e.is_file(follow_symlinks=False) and not e.name.endswith((".dat", ".u8"))
        )


def read_fortunes(path: str) -> list[str]:
    """The non-empty fortunes of one file, stripped, in file order."""
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        lines = f.read().split("\n")
    fortunes, current = [], []
    for line in lines + ["%"]:
        if line.rstrip("\r") == "%":
            text = "\n".join(current).strip()
            if text:
                fortunes.append(text)
            current = []
        else:
            current.append(line.rstrip("\r"))
    return fortunes


def prepare(source_dir: str, output: str) -> tuple[int, int]:
    """Write every fortune of `source_dir` to `output`; returns (documents, bytes)."""
    data = b"".join(
        json.dumps({"text": text}, ensure_ascii=False).encode() + b"\n"
        for path in fortune_files(source_dir)
        for text in read_fortunes(path)
    )
    with atomic_output(output) as tmp, open(tmp, "wb") as f:
        f.write(data)
    return data.count(b"\n"), len(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source-dir", default=DEFAULT_SOURCE, help="directory of fortune files")
    parser.add_argument(
        "--output", default="data/fortunes.jsonl", help="the JSON lines file to write"
    )
    args = parser.parse_args(argv)
    if not os.path.isdir(args.source_dir):
        print(
            f"{args.source_dir} does not exist: install the Debian package `fortunes` "
            "(apt-get install fortunes) "
            "or point --source-dir at a directory of fortune files",
            file=sys.stderr,
        )
        return 2
    documents, size = prepare(args.source_dir, args.output)
    print(f"{args.output}: {documents} documents, {size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
