"""tpcore-convert (checkpoint -> dense safetensors) and examples/generate.py, on a checkpoint
made by the real trainer at TP=2 (once per module: the trainer runs as torchrun processes)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")
import safetensors.torch  # noqa: E402

from harness import REPO_ROOT  # noqa: E402
from launch import torchrun  # noqa: E402
from tpcore.data import load_tokenizer  # noqa: E402
from tpcore.data.preprocess import preprocess  # noqa: E402
from tpcore.models import ReferenceGPT, generate  # noqa: E402
from tpcore.train import (  # noqa: E402
    CheckpointError,
    convert,  # noqa: E402
    export_safetensors,
    load_dense_gpt,
    load_dense_state_dict,
)

ROOT = REPO_ROOT
GENERATE = ROOT / "examples" / "generate.py"
TIMEOUT = 300
PROMPT, NEW = "The quick", 24


def _run_ranks(nproc: int, program: list, cwd) -> str:
    """`torchrun --nproc_per_node nproc program` (launch.torchrun); its stdout (no newline
    translation) or a failure with its output."""
    proc = torchrun(program, nproc, cwd=cwd, timeout=TIMEOUT)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, program))} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    )
    return proc.stdout


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A 3-step TP=2 checkpoint of a tiny GPT trained on a tiny byte-level corpus."""
    work = tmp_path_factory.mktemp("convert")
    corpus = work / "docs.jsonl"
    corpus.write_text(
        "".join(
            json.dumps({"text": f"The quick brown fox {i} jumps over the lazy dog. " * 3}) + "\n"
            for i in range(40)
        )
    )
    preprocess(str(corpus), str(work / "data" / "docs"), append_eod=True)
    _run_ranks(
        2,
        [
            "-m",
            "tpcore.train",
            "--data-path",
            str(work / "data" / "docs"),
            "--num-layers",
            "2",
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "16",
            "--micro-batch-size",
            "2",
            "--train-iters",
            "3",
            "--eval-iters",
            "0",
            "--lr",
            "0.01",
            "--tensor-parallel-size",
            "2",
            "--save",
            str(work / "ckpt"),
            "--device",
            "cpu",
            "--no-progress",
        ],
        cwd=work,
    )
    assert (work / "ckpt" / "latest").read_text().strip() == "iter_0000003"
    return work / "ckpt"


@pytest.fixture(scope="module")
def dense_file(ckpt, tmp_path_factory) -> Path:
    return Path(
        export_safetensors(str(ckpt), str(tmp_path_factory.mktemp("export") / "model.safetensors"))
    )


def test_export_round_trip(ckpt, dense_file):
    config, state = load_dense_state_dict(str(ckpt))
    model, meta = load_dense_gpt(str(dense_file))
    assert isinstance(model, ReferenceGPT) and not model.training
    assert (
        meta["format"] == "tpcore-gpt-dense"
        and meta["iteration"] == "3"
        and meta["tokenizer"] == "byte"
    )
    assert json.loads(meta["model_config"]) == dataclasses.asdict(config) and model.config == config
    loaded = model.state_dict()
    assert loaded.keys() == state.keys()
    for name, tensor in state.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    reference = ReferenceGPT(config)
    reference.load_state_dict(state)
    reference.eval()
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))
    half, _ = load_dense_gpt(str(dense_file), dtype=torch.bfloat16)
    assert next(half.parameters()).dtype == torch.bfloat16
    # An iter_N directory names the same checkpoint as its save directory.
    again = export_safetensors(
        str(ckpt / "iter_0000003"), str(dense_file.parent / "again.safetensors")
    )
    model2, meta2 = load_dense_gpt(again)
    assert meta2 == meta and all(torch.equal(t, loaded[k]) for k, t in model2.state_dict().items())


def test_parameters_are_the_shards_concatenated(ckpt, dense_file):
    shards = [
        torch.load(ckpt / "iter_0000003" / f"model_tp0{r}_pp00.pt", weights_only=True)["model"]
        for r in range(2)
    ]
    dense = safetensors.torch.load_file(str(dense_file))
    c, name = load_dense_state_dict(str(ckpt))[0], "layers.1.attention.proj.weight"
    assert torch.equal(
        dense[name], torch.cat([s[name] for s in shards], 1)
    )  # row parallel: input dim
    name = "layers.0.mlp.fc1.weight"
    assert torch.equal(
        dense[name], torch.cat([s[name] for s in shards], 0)
    )  # column parallel: output dim
    name = "layers.0.attention.qkv.weight"  # per rank [q_r; k_r; v_r]: whole heads of each
    q, k, v = zip(*(s[name].split(c.hidden_size // 2, 0) for s in shards))
    assert torch.equal(dense[name], torch.cat([*q, *k, *v], 0))
    name = "embedding.word.weight"  # vocab rows, padding dropped
    assert torch.equal(dense[name], torch.cat([s[name] for s in shards], 0)[: c.vocab_size])
    assert dense[name].shape == (257, 32)
    name = "layers.0.input_norm.weight"  # replicated
    assert torch.equal(dense[name], shards[0][name]) and torch.equal(dense[name], shards[1][name])


def test_cli(ckpt, tmp_path, capsys):
    out = tmp_path / "cli" / "gpt.safetensors"
    assert convert.main(["--load", str(ckpt), "--output", str(out)]) == 0
    params = sum(p.numel() for p in load_dense_gpt(str(out))[0].parameters())
    printed = capsys.readouterr().out
    assert str(out) in printed and f"{params:,} parameters" in printed and "iteration 3" in printed
    assert os.listdir(out.parent) == ["gpt.safetensors"]  # no temporary file left
    assert (out.stat().st_mode & 0o777) == 0o666 & ~_umask()

    assert (
        convert.main(
            ["--load", str(tmp_path / "nothing"), "--output", str(tmp_path / "x.safetensors")]
        )
        == 1
    )
    assert (
        "nothing does not exist (a typo?)" in capsys.readouterr().err
        and not (tmp_path / "x.safetensors").exists()
    )
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint in .*empty"):
        export_safetensors(str(tmp_path / "empty"), str(tmp_path / "x.safetensors"))

    foreign = tmp_path / "foreign.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(2)}, str(foreign), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{foreign}.*not a tpcore-gpt-dense"):
        load_dense_gpt(str(foreign))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=f"{junk} is not a safetensors file"):
        load_dense_gpt(str(junk))


def test_failed_export_keeps_the_old_file(ckpt, tmp_path, monkeypatch, capsys):
    out = tmp_path / "gpt.safetensors"
    old = Path(export_safetensors(str(ckpt), str(out))).read_bytes()

    def broken(tensors, path, metadata=None):
        open(path, "wb").write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        export_safetensors(str(ckpt), str(out))
    assert out.read_bytes() == old and os.listdir(tmp_path) == ["gpt.safetensors"]

    def read_only(
        tensors, path, metadata=None
    ):  # what safetensors raises in a read-only folder: no OSError, a traceback
        raise safetensors.SafetensorError(
            "Error while serializing: I/O error: Read-only file system (os error 30) "
            f'at path "{path}"'
        )

    monkeypatch.setattr(safetensors.torch, "save_file", read_only)
    assert convert.main(["--load", str(ckpt), "--output", str(out)]) == 1
    assert (
        f"tpcore: writing {out} failed: Error while serializing: I/O error: Read-only file system"
        in capsys.readouterr().err
    )
    assert out.read_bytes() == old and os.listdir(tmp_path) == ["gpt.safetensors"]


def test_output_that_is_not_an_earlier_export_is_refused(ckpt, tmp_path, capsys):
    """--output naming one of the checkpoint's own files (a shard, metadata.json, latest) replaced
    it (the checkpoint lost), as it replaced any other file; a folder failed after the whole
    export, naming a temporary file. Refused before anything is read or written, naming the
    path; an earlier export is replaced. --to-hf naming a file: a bare "[Errno 17] File exists"."""
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    iteration = copy / "iter_0000003"
    (tmp_path / "notes.txt").write_text("keep")
    targets = [
        iteration / "model_tp01_pp00.pt",
        iteration / "metadata.json",
        copy / "latest",
        tmp_path / "notes.txt",
    ]
    before = {target: target.read_bytes() for target in targets}
    for target in targets:
        assert convert.main(["--load", str(copy), "--output", str(target)]) == 1
        assert (
            f"tpcore: {target} exists and is not an earlier export of tpcore-convert"
            in capsys.readouterr().err
        )
    assert all(target.read_bytes() == data for target, data in before.items())
    for folder in (copy, iteration):
        assert convert.main(["--load", str(copy), "--output", str(folder)]) == 1
        assert (
            f"tpcore: {folder} is a folder; the export writes one .safetensors file"
            in capsys.readouterr().err
        )
    assert convert.main(["--load", str(copy), "--to-hf", str(tmp_path / "notes.txt")]) == 1
    assert (
        f"tpcore: {tmp_path / 'notes.txt'} is a file; the export writes a folder there"
        in capsys.readouterr().err
    )
    assert before[tmp_path / "notes.txt"] == (tmp_path / "notes.txt").read_bytes()
    out = tmp_path / "gpt.safetensors"
    assert convert.main(["--load", str(copy), "--output", str(out)]) == 0
    assert (
        convert.main(["--load", str(copy), "--output", str(out)]) == 0
    )  # an earlier export is replaced
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "gpt.safetensors", "notes.txt"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _example_main():
    spec = importlib.util.spec_from_file_location("tpcore_example_generate", GENERATE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_generate_example_same_text_at_every_tp(ckpt, dense_file, tmp_path, capsys):
    model, _ = load_dense_gpt(str(dense_file))
    tok = load_tokenizer("byte")
    tokens = generate(model, torch.tensor([tok.encode(PROMPT)]), NEW, greedy=True, eod=tok.eod)
    expected = tok.decode(tokens[0].tolist()) + "\n"
    assert tokens.shape[1] > len(PROMPT)

    flags = [
        "--load",
        str(ckpt),
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        str(NEW),
        "--greedy",
        "--device",
        "cpu",
    ]
    tp2 = _run_ranks(2, [GENERATE, *flags, "--tensor-parallel-size", "2"], tmp_path)
    tp1 = _run_ranks(1, [GENERATE, *flags], tmp_path)  # one rank: the TP=2 checkpoint resharded
    assert (
        _example_main()(
            [
                "--dense",
                str(dense_file),
                "--prompt",
                PROMPT,
                "--max-new-tokens",
                str(NEW),
                "--greedy",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    from_dense = capsys.readouterr().out
    assert tp2 == expected, f"TP=2: {tp2!r} != {expected!r}"  # printed once (rank 0 only)
    assert tp1 == expected, f"TP=1: {tp1!r} != {expected!r}"
    assert from_dense == expected, f"dense: {from_dense!r} != {expected!r}"


def test_to_hf_native_checkpoint_loads_in_transformers(ckpt, tmp_path):
    """A natively built GPT (LayerNorm, tanh GeLU, learned positions, tied head) exports as
    GPT-2: transformers gives the checkpoint's logits; the byte tokenizer's end of document
    is the eos id; an architecture no family has is refused before anything is written."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert convert.main(["--load", str(ckpt), "--to-hf", str(out)]) == 0
    config, state = load_dense_state_dict(str(ckpt))
    reference = ReferenceGPT(config, device="meta")
    reference.load_state_dict(state, assign=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert (
        type(hf).__name__ == "GPT2LMHeadModel"
        and hf.config.eos_token_id == hf.config.bos_token_id == load_tokenizer("byte").eod
    )
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, reference.eval()(ids), rtol=1e-5, atol=1e-5)
    assert not (out / "tokenizer.json").exists()  # the byte tokenizer has no files
    # RMSNorm with GeLU: no Hugging Face family.
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    meta_path = bad / (bad / "latest").read_text().strip() / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["model_config"]["norm"] = "rmsnorm"
    meta_path.write_text(json.dumps(meta))
    assert (
        convert.main(["--load", str(bad), "--to-hf", str(tmp_path / "bad_hf"), "--no-verify"]) == 1
    )
    assert not (tmp_path / "bad_hf").exists()


def test_to_hf_into_a_folder_with_other_files_is_refused(ckpt, tmp_path, capsys):
    """A byte-level checkpoint exported into a folder that holds another model's
    tokenizer.json would leave it beside the new model (transformers would load that
    tokenizer with it: ids the model never saw). Refused, naming the file, nothing written;
    an earlier export in the folder is replaced (exporting again is fine)."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    assert convert.main(["--load", str(ckpt), "--to-hf", str(out)]) == 1
    err = capsys.readouterr().err
    assert (
        f"{out} already holds ['tokenizer.json'], which the export would not write" in err
        and "empty or new folder" in err
    ), err
    assert os.listdir(out) == ["tokenizer.json"]  # untouched
    again = tmp_path / "again"
    assert convert.main(["--load", str(ckpt), "--to-hf", str(again)]) == 0
    first = {name: (again / name).read_bytes() for name in os.listdir(again)}
    assert convert.main(["--load", str(ckpt), "--to-hf", str(again), "--dtype", "bfloat16"]) == 0
    assert (
        sorted(os.listdir(again)) == sorted(first)
        and (again / "model.safetensors").read_bytes() != first["model.safetensors"]
    )


def test_to_hf_into_the_runs_load_hf_folder_is_refused(ckpt, tmp_path, capsys):
    """A run started from a Hugging Face folder (--load-hf) that holds only files an export
    writes (config.json, model.safetensors): --to-hf into it replaced that model's weights,
    the folder the trainer's --save-hf refuses. Refused, nothing written."""
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text("{}")
    (source / "model.safetensors").write_bytes(b"the weights training started from")
    meta_path = copy / "iter_0000003" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["args"]["load_hf"] = str(tmp_path / "." / "source")
    meta_path.write_text(json.dumps(meta))
    assert convert.main(["--load", str(copy), "--to-hf", str(source)]) == 1
    assert (
        f"tpcore: {source} is the Hugging Face folder the run started from (--load-hf"
        in capsys.readouterr().err
    )
    assert (source / "model.safetensors").read_bytes() == b"the weights training started from"
    assert sorted(os.listdir(source)) == ["config.json", "model.safetensors"]
