"""tpcore-preprocess: JSON lines / text to .bin/.idx, malformed lines, workers, atomic output."""

from __future__ import annotations

import errno
import json
import os

import pytest

from tpcore.data import ByteTokenizer, IndexedDataset
from tpcore.data.preprocess import main, preprocess

TEXTS = ["Hello, world.", "Ünïcödé works too", "a" * 3000, "last one"]


def _jsonl(path, lines):
    path.write_bytes(
        b"".join((line if isinstance(line, bytes) else line.encode()) + b"\n" for line in lines)
    )
    return str(path)


def test_jsonl_round_trip_with_eod(tmp_path):
    src = _jsonl(
        tmp_path / "in.jsonl", [json.dumps({"text": t, "id": i}) for i, t in enumerate(TEXTS)]
    )
    prefix = str(tmp_path / "out" / "ds")
    assert main(["--input", src, "--output-prefix", prefix, "--append-eod", "--quiet"]) == 0
    ds, tok = IndexedDataset(prefix), ByteTokenizer()
    assert len(ds) == len(TEXTS)
    for i, text in enumerate(TEXTS):
        ids = ds[i].tolist()
        assert ids[-1] == tok.eod and tok.decode(ids[:-1]) == text


def test_malformed_lines_skipped_and_counted(tmp_path, capsys):
    lines = [
        json.dumps({"text": "good"}),
        "{not json",
        json.dumps({"body": "x"}),
        json.dumps({"text": 5}),
        b"\xff\xfe",
        "",
        json.dumps({"text": "also good"}),
    ]
    src = _jsonl(tmp_path / "in.jsonl", lines)
    prefix = str(tmp_path / "ds")
    assert main(["--input", src, "--output-prefix", prefix, "--quiet"]) == 0
    assert "2 documents" in capsys.readouterr().out and len(IndexedDataset(prefix)) == 2
    assert (
        main(
            [
                "--input",
                src,
                "--output-prefix",
                str(tmp_path / "strict"),
                "--on-error",
                "fail",
                "--quiet",
            ]
        )
        == 1
    )
    assert "line 2" in capsys.readouterr().err
    assert not any(n.startswith("strict") for n in os.listdir(tmp_path)), (
        "a failed run must leave no output"
    )


def test_workers_give_the_same_dataset(tmp_path):
    src = _jsonl(
        tmp_path / "in.jsonl",
        [json.dumps({"text": f"document {i} " * (i % 7 + 1)}) for i in range(2000)],
    )
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
    assert [ByteTokenizer().decode(d.tolist()) for d in IndexedDataset(prefix)] == [
        "first line",
        "second line",
    ]
    src = _jsonl(tmp_path / "k.jsonl", [json.dumps({"content": "x y"})])
    assert (
        main(
            [
                "--input",
                src,
                "--output-prefix",
                str(tmp_path / "k"),
                "--json-key",
                "content",
                "--quiet",
            ]
        )
        == 0
    )
    assert len(IndexedDataset(str(tmp_path / "k"))) == 1


def test_utf8_byte_order_mark_keeps_the_first_document(tmp_path, capsys):
    """Editors on Windows start UTF-8 files with a byte-order mark; it is no part of the
    first document (as Python's "utf-8-sig" reads it), which must not be lost or changed."""
    bom = "\ufeff".encode()
    src = tmp_path / "bom.jsonl"
    src.write_bytes(bom + b"".join(json.dumps({"text": t}).encode() + b"\n" for t in TEXTS))
    prefix = str(tmp_path / "bom")
    assert main(["--input", str(src), "--output-prefix", prefix, "--quiet"]) == 0
    assert "0 malformed lines skipped" in capsys.readouterr().out
    expected = [
        json.loads(line)["text"] for line in src.read_text(encoding="utf-8-sig").splitlines()
    ]
    assert [ByteTokenizer().decode(d.tolist()) for d in IndexedDataset(prefix)] == expected == TEXTS
    txt = tmp_path / "bom.txt"
    txt.write_bytes(bom + b"first line\nsecond line\n")
    assert main(["--input", str(txt), "--output-prefix", str(tmp_path / "t"), "--quiet"]) == 0
    assert [ByteTokenizer().decode(d.tolist()) for d in IndexedDataset(str(tmp_path / "t"))] == [
        "first line",
        "second line",
    ]


def test_missing_input(tmp_path, capsys):
    assert (
        main(
            [
                "--input",
                str(tmp_path / "nope.jsonl"),
                "--output-prefix",
                str(tmp_path / "x"),
                "--quiet",
            ]
        )
        == 1
    )
    assert "does not exist" in capsys.readouterr().err


class _FullDisk:
    """A file on a disk with `room` bytes left: a write past it fails with ENOSPC, either at
    once or, as buffered writes do, only when close() flushes."""

    def __init__(self, f, room: int, at_close: bool) -> None:
        self.f, self.room, self.at_close, self.pending = f, room, at_close, False

    def write(self, data) -> int:
        if len(data) > self.room:
            if not self.at_close:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.pending = True
            return len(data)
        self.room -= len(data)
        return self.f.write(data)

    def close(self) -> None:
        self.f.close()
        if self.pending:
            self.pending = False
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@pytest.mark.parametrize(
    "ext, room, at_close", [(".bin", 100, False), (".bin", 100, True), (".idx", 10, False)]
)
def test_full_disk_names_enospc_and_leaves_nothing(
    tmp_path, monkeypatch, capsys, ext, room, at_close
):
    """A full disk while writing the tokens (at the write or at the flush on close) or the index:
    exit 1 with ENOSPC and the file named, no temporary `PREFIX.tmpPID.*` and no output left."""
    import builtins

    from tpcore.data import indexed_dataset

    def full_disk_open(path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        return _FullDisk(f, room, at_close) if "w" in mode and str(path).endswith(ext) else f

    monkeypatch.setattr(indexed_dataset, "open", full_disk_open, raising=False)
    src = _jsonl(tmp_path / "in.jsonl", [json.dumps({"text": t}) for t in TEXTS])
    out = tmp_path / "out"
    assert main(["--input", src, "--output-prefix", str(out / "ds"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "ENOSPC" in err and str(out / f"ds.tmp{os.getpid()}{ext}") in err, err
    assert os.listdir(out) == [], "a failed run must leave no temporary or partial files"


def test_json_key_absent_everywhere_fails_naming_key_and_file(tmp_path, capsys):
    """A wrong --json-key made an empty dataset and exit 0; now it names the key, the file
    and the keys the lines do have, and leaves no output."""
    src = _jsonl(
        tmp_path / "in.jsonl", [json.dumps({"body": t, "id": i}) for i, t in enumerate(TEXTS)]
    )
    out = tmp_path / "out"
    assert main(["--input", src, "--output-prefix", str(out / "ds"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert (
        "'text'" in err
        and src in err
        and "--json-key" in err
        and "'body'" in err
        and "4 lines" in err
    ), err
    assert not out.exists() or os.listdir(out) == []
    with pytest.raises(ValueError, match="no line of .* has a string field 'text'"):
        preprocess(src, str(out / "api"))


def test_json_key_absent_from_some_lines_is_reported(tmp_path, capsys):
    lines = [
        json.dumps({"text": "a"}),
        json.dumps({"body": "b"}),
        json.dumps({"text": 7}),
        json.dumps({"body": "c"}),
        "{bad",
    ]
    src = _jsonl(tmp_path / "in.jsonl", lines)
    prefix = str(tmp_path / "ds")
    assert main(["--input", src, "--output-prefix", prefix, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert (
        "1 documents" in out
        and "4 malformed lines skipped" in out
        and "2 without the key 'text'" in out
    ), out
    counts = preprocess(src, str(tmp_path / "api"))
    assert (counts["documents"], counts["skipped"], counts["missing_key"]) == (1, 4, 2)


def test_no_document_at_all_fails_and_names_the_first_bad_line(tmp_path, capsys):
    """Plain text read as JSON lines gave an empty dataset and exit 0."""
    src = tmp_path / "plain.jsonl"
    src.write_text("just words\nmore words\n")
    out = tmp_path / "out"
    assert main(["--input", str(src), "--output-prefix", str(out / "ds"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert (
        "no line of" in err and "2 malformed lines" in err and "line 1" in err and "--format" in err
    ), err
    assert not out.exists() or os.listdir(out) == []
    src.write_text("\n  \n")  # empty but for blank lines
    assert main(["--input", str(src), "--output-prefix", str(out / "ds"), "--quiet"]) == 1
    assert "holds no document (it is empty or only blank lines)" in capsys.readouterr().err
    assert not out.exists() or os.listdir(out) == []


def test_an_output_folder_that_cannot_be_made_is_named(tmp_path, capsys):
    """A file in the way of the output folder, or a folder that cannot be written: the
    message names the path and the errno, with the tpcore prefix."""
    src = _jsonl(tmp_path / "in.jsonl", [json.dumps({"text": "x"})])
    (tmp_path / "afile").write_text("")
    assert main(["--input", src, "--output-prefix", str(tmp_path / "afile" / "ds"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith("tpcore: writing")
        and "afile" in err
        and ("EEXIST" in err or "ENOTDIR" in err)
    ), err


def test_builder_names_a_file_it_cannot_create(tmp_path):
    from tpcore.data import IndexedDatasetBuilder

    with pytest.raises(OSError, match=r"tpcore: writing .*missing/ds\.tmp\d+\.bin failed: ENOENT"):
        IndexedDatasetBuilder(str(tmp_path / "missing" / "ds"))


def test_module_entry_point_runs_without_runpy_warning(tmp_path):
    """`python -m tpcore.data.preprocess` (the Makefile's corpus step) printed runpy's
    RuntimeWarning about the module being imported already, at every run."""
    import subprocess
    import sys

    src = _jsonl(tmp_path / "in.jsonl", [json.dumps({"text": "x"})])
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "tpcore.data.preprocess",
            "--input",
            src,
            "--output-prefix",
            str(tmp_path / "ds"),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and "Warning" not in run.stderr, run.stderr
    assert len(IndexedDataset(str(tmp_path / "ds"))) == 1
