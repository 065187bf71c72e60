"""tpcore-train-tokenizer: byte-level BPE that round-trips any text, inputs, errors, CLI,
preprocess."""

from __future__ import annotations

import json
import os
import random

import pytest

from tpcore.data import IndexedDataset, load_tokenizer, preprocess, train_tokenizer
from tpcore.data.train_tokenizer import main

WORDS = (
    "the of and to in is was that for it with as on be at by this had not are but from "
    "or have an they which you were her all she there would their we him been has when "
    "who will more no if out so said what up its about into than them can only other new "
    "some could time these two may then do first any my now such like our over man me "
    "even most made after also did many before must through back years where much your "
    "way well down should because each just those people"
).split()


def _corpus(n: int = 600, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))).capitalize() + "."
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tok")
    src = tmp / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in _corpus()))
    return train_tokenizer([str(src)], str(tmp / "tokenizer.json"), vocab_size=400), str(src)


def test_loads_and_round_trips_any_text(trained):
    tok = load_tokenizer(trained[0])
    assert 257 < tok.vocab_size <= 400
    assert tok.eod == tok._tok.token_to_id("<|endoftext|>")
    texts = [
        "the people would have been there",
        "  leading spaces\tand tabs\n\nnewlines ",
        "Ünïcödé — 日本語 🙂 emoji",
        "zyzzyva qwxj 12345 !@#$%^&*()",
        "\x00\x7f control",
        "",
    ]
    for text in texts:
        assert tok.decode(tok.encode(text)) == text
    common = "the people would have been there because"
    assert len(tok.encode(common)) < len(common.encode()) // 2


def test_plain_text_input(tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_text("\n".join(_corpus(300, seed=1)) + "\n\n")
    path = train_tokenizer([str(src)], str(tmp_path / "sub" / "t.json"), vocab_size=300, fmt="auto")
    tok = load_tokenizer(path)
    assert (
        257 < tok.vocab_size <= 300
        and tok.decode(tok.encode("which were many")) == "which were many"
    )


def test_errors(tmp_path, trained):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        train_tokenizer([str(tmp_path / "nope.jsonl")], str(tmp_path / "t.json"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n\n{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 3"):
        train_tokenizer([str(bad)], str(tmp_path / "t.json"))
    with pytest.raises(ValueError, match="too small"):
        train_tokenizer([trained[1]], str(tmp_path / "t.json"), vocab_size=257)
    assert os.listdir(tmp_path) == ["bad.jsonl"], "a failed run must leave no output"


def test_cli(tmp_path, capsys, trained):
    out = str(tmp_path / "cli.json")
    assert (
        main(
            ["--input", trained[1], "--output", out, "--vocab-size", "300", "--min-frequency", "3"]
        )
        == 0
    )
    assert out in capsys.readouterr().out and load_tokenizer(out).vocab_size <= 300
    assert os.listdir(tmp_path) == ["cli.json"], "no temporary file may be left behind"
    assert main(["--input", str(tmp_path / "missing.txt"), "--output", out]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_preprocess_with_trained_tokenizer(tmp_path, trained):
    texts = _corpus(20, seed=2) + ["Ünïcödé and words not in the corpus"]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prefix = str(tmp_path / "ds")
    counts = preprocess(str(src), prefix, tokenizer=trained[0], append_eod=True)
    tok, ds = load_tokenizer(trained[0]), IndexedDataset(prefix)
    assert counts["documents"] == len(ds) == len(texts)
    for doc, text in zip(ds, texts):
        ids = doc.tolist()
        assert ids[-1] == tok.eod and tok.decode(ids[:-1]) == text


def test_bad_tokenizer_path_is_named(tmp_path, capsys):
    """A missing path, a directory, a file that is not JSON and a JSON file that is not a
    tokenizer each raise naming the path (the tokenizers library's own errors name nothing)."""
    not_json, not_tok = tmp_path / "notes.txt", tmp_path / "config.json"
    not_json.write_text("just some text\n")
    not_tok.write_text(json.dumps({"vocab_size": 5}))
    cases = [
        (tmp_path / "missing.json", FileNotFoundError, "does not exist"),
        (tmp_path, IsADirectoryError, "is a directory"),
        (not_json, ValueError, "is not a tokenizer.json"),
        (not_tok, ValueError, "is not a tokenizer.json"),
    ]
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "hello"}) + "\n")
    for path, error, cause in cases:
        with pytest.raises(error) as info:
            load_tokenizer(str(path))
        assert f"--tokenizer {path}" in str(info.value) and cause in str(info.value), str(
            info.value
        )
        # The preprocess CLI exits 1 with the same message, not a traceback.
        from tpcore.data.preprocess import main as preprocess_main

        assert (
            preprocess_main(
                [
                    "--input",
                    str(src),
                    "--output-prefix",
                    str(tmp_path / "out" / "ds"),
                    "--tokenizer",
                    str(path),
                    "--quiet",
                ]
            )
            == 1
        )
        assert f"--tokenizer {path}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []
