"""tpcore-preprocess: JSON lines / text to .bin/.idx, malformed lines, workers, atomic output."""

from __future__ import annotations

import json
import os

import pytest

from tpcore.data import ByteTokenizer, IndexedDataset
from tpcore.data.preprocess import main

TEXTS = ["Hello, world.", "Ünïcödé works too", "a" * 3000, "last one"]


def _jsonl(path, lines):
    path.write_bytes(b"".join((l if isinstance(l, bytes) else l.encode()) + b"\n" for l in lines))
    return str(path)


def test_jsonl_round_trip_with_eod(tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", [json.dumps({"text": t, "id": i}) for i, t in enumerate(TEXTS)])
    prefix = str(tmp_path / "out" / "ds")
    assert main(["--input", src, "--output-prefix", prefix, "--append-eod", "--quiet"]) == 0
    ds, tok = IndexedDataset(prefix), ByteTokenizer()
    assert len(ds) == len(TEXTS)
    for i, text in enumerate(TEXTS):
        ids = ds[i].tolist()
        assert ids[-1] == tok.eod and tok.decode(ids[:-1]) == text


def test_malformed_lines_skipped_and_counted(tmp_path, capsys):
    lines = [json.dumps({"text": "good"}), "{not json", json.dumps({"body": "x"}), json.dumps({"text": 5}), b"\xff\xfe", "", json.dumps({"text": "also good"})]
    src = _jsonl(tmp_path / "in.jsonl", lines)
    prefix = str(tmp_path / "ds")
    assert main(["--input", src, "--output-prefix", prefix, "--quiet"]) == 0
    assert "2 documents" in capsys.readouterr().out and len(IndexedDataset(prefix)) == 2
    assert main(["--input", src, "--output-prefix", str(tmp_path / "strict"), "--on-error", "fail", "--quiet"]) == 1
    assert "line 2" in capsys.readouterr().err
    assert not any(n.startswith("strict") for n in os.listdir(tmp_path)), "a failed run must leave no output"


def test_workers_give_the_same_dataset(tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", [json.dumps({"text": f"document {i} " * (i % 7 + 1)}) for i in range(2000)])
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    assert main(["--input", src, "--output-prefix", one, "--quiet"]) == 0
    assert main(["--input", src, "--output-prefix", two, "--workers", "2", "--quiet"]) == 0
    for ext in (".bin", ".idx"):
        assert open(one + ext, "rb").read() == open(two + ext, "rb").read()


def test_plain_text_and_custom_key(tmp_path):
    txt = tmp_path / "in.txt"
    txt.write_text("first line\n\n  \nsecond line\n")
    prefix = str(tmp_path / "t")
    assert main(["--input", str(txt), "--output-prefix", prefix, "--quiet"]) == 0
    assert [ByteTokenizer().decode(d.tolist()) for d in IndexedDataset(prefix)] == ["first line", "second line"]
    src = _jsonl(tmp_path / "k.jsonl", [json.dumps({"content": "x y"})])
    assert main(["--input", src, "--output-prefix", str(tmp_path / "k"), "--json-key", "content", "--quiet"]) == 0
    assert len(IndexedDataset(str(tmp_path / "k"))) == 1


def test_missing_input(tmp_path, capsys):
    assert main(["--input", str(tmp_path / "nope.jsonl"), "--output-prefix", str(tmp_path / "x"), "--quiet"]) == 1
    assert "does not exist" in capsys.readouterr().err
