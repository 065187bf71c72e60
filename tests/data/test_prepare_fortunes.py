"""examples/prepare_fortunes.py: fortune files to JSON lines, skipped files, bad bytes,
missing source."""

from __future__ import annotations

import importlib.util
import json
import os

from harness import REPO_ROOT

SCRIPT = REPO_ROOT / "examples" / "prepare_fortunes.py"


def _script():
    spec = importlib.util.spec_from_file_location("prepare_fortunes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fortunes_to_jsonl(tmp_path, capsys):
    src = tmp_path / "fortunes"
    src.mkdir()
    # "zoo" sorts after "animals": files are read in name order, not creation order.
    (src / "zoo").write_bytes(b"Caf\xe9 latin-1 here.\n%\n  last one  \n")
    (src / "animals").write_bytes(
        b"A cat.\n\t\t-- Someone\n%\n\n%\n  \n%\nTwo\n\nparagraphs\n%\n%x is not a separator\n%\n"
    )
    (src / "animals.dat").write_bytes(b"\x00\x00\x00\x02binary index")
    os.symlink("animals", src / "animals.u8")
    os.symlink("zoo", src / "link")
    (src / "off").mkdir()
    (src / "off" / "rude").write_text("skipped\n%\n")
    out = tmp_path / "out" / "f.jsonl"
    assert _script().main(["--source-dir", str(src), "--output", str(out)]) == 0
    expected = [
        "A cat.\n\t\t-- Someone",
        "Two\n\nparagraphs",
        "%x is not a separator",
        "Caf\ufffd latin-1 here.",
        "last one",
    ]
    data = out.read_bytes()
    assert data == b"".join(
        json.dumps({"text": t}, ensure_ascii=False).encode() + b"\n" for t in expected
    )
    assert [json.loads(line)["text"] for line in data.decode().splitlines()] == expected
    assert f"{len(expected)} documents, {len(data)} bytes" in capsys.readouterr().out
    assert os.listdir(out.parent) == ["f.jsonl"], "no temporary file may be left behind"


def test_missing_source_dir(tmp_path, capsys):
    out = tmp_path / "f.jsonl"
    assert _script().main(["--source-dir", str(tmp_path / "nope"), "--output", str(out)]) == 2
    assert "apt-get install fortunes" in capsys.readouterr().err and not out.exists()
