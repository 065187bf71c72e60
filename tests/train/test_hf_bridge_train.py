"""Continued pretraining of a Hugging Face Llama (and a Qwen3) with the real trainer (torchrun,
TP 2 x PP 2 on 4 CPU ranks), then out to transformers: `--load-hf` starts from the folder's
architecture, weights and tokenizer (the data preprocessed with `--tokenizer FOLDER`), the
first step's loss equals transformers' on the same batch, training lowers it; `--save-hf`
and `tpcore-convert --to-hf` of the checkpoint both give a folder transformers loads with
logits equal to tpcore's for that checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
safetensors = pytest.importorskip("safetensors.torch")

from hf_train_data import hf_model_and_data  # noqa: E402

from launch import torchrun  # noqa: E402
from tpcore.data import GPTDataset, IndexedDataset  # noqa: E402
from tpcore.models import ReferenceGPT  # noqa: E402
from tpcore.train import convert, load_dense_state_dict  # noqa: E402
from tpcore.train.logger import read_metrics  # noqa: E402

SEQ, GLOBAL_BATCH, ITERS, SEED = 16, 4, 6, 1234


def _all_tensors(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    names = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    tensors = {}
    for name in names:
        tensors.update(safetensors.load_file(str(folder / name)))
    return tensors


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma"])
def run(request, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("hf_train")
    folder, model = hf_model_and_data(work, request.param)
    proc = torchrun(
        [
            "-m",
            "tpcore.train",
            "--load-hf",
            str(folder),
            "--data-path",
            str(work / "data" / "docs"),
            "--seq-length",
            str(SEQ),
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            str(GLOBAL_BATCH),
            "--train-iters",
            str(ITERS),
            "--eval-iters",
            "0",
            "--lr",
            "3e-3",
            "--lr-warmup-iters",
            "0",
            "--lr-decay-style",
            "constant",
            "--log-interval",
            "1",
            "--tensor-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--save",
            str(work / "ckpt"),
            "--save-hf",
            str(work / "exported"),
            "--device",
            "cpu",
            "--no-progress",
            "--seed",
            str(SEED),
        ],
        4,
        cwd=work,
        timeout=400,
    )
    assert proc.returncode == 0, (
        f"training failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    )
    return {"work": work, "folder": folder, "model": model}


def test_first_step_loss_equals_transformers_and_training_lowers_it(run):
    work, model = run["work"], run["model"]
    indexed = IndexedDataset(str(work / "data" / "docs"))
    dataset = GPTDataset(
        indexed, SEQ, ITERS * GLOBAL_BATCH, split="train", valid_fraction=0.05, seed=SEED
    )
    rows = torch.stack(
        [dataset[i] for i in range(GLOBAL_BATCH)]
    )  # the first global batch, [4, SEQ + 1]
    with torch.no_grad():
        # transformers shifts the labels itself: positions 0..SEQ-1 predict tokens 1..SEQ, as the
        # trainer's targets.
        expected = model(input_ids=rows, labels=rows).loss.item()
    losses = [row["loss"] for row in read_metrics(str(work / "ckpt" / "metrics.csv"))]
    assert len(losses) == ITERS
    assert losses[0] == pytest.approx(expected, rel=1e-5), (losses[0], expected)
    assert losses[-1] < losses[0] - 0.1, losses


def _dense_logits(checkpoint: Path, ids: torch.Tensor) -> torch.Tensor:
    config, state = load_dense_state_dict(str(checkpoint))
    reference = ReferenceGPT(config, device="meta")
    reference.load_state_dict(state, assign=True)
    with torch.no_grad():
        return reference.eval()(ids)


def test_save_hf_and_to_hf_give_the_checkpoints_logits(run, tmp_path):
    work = run["work"]
    ids = torch.randint(
        0, run["model"].config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3)
    )
    expected = _dense_logits(work / "ckpt", ids)
    converted = tmp_path / "converted"
    assert convert.main(["--load", str(work / "ckpt"), "--to-hf", str(converted)]) == 0
    saved = _all_tensors(work / "exported")
    assert saved.keys() == _all_tensors(converted).keys()
    for key, tensor in _all_tensors(
        converted
    ).items():  # the trainer's export and the converter's agree bit for bit
        assert torch.equal(tensor, saved[key]), key
    for folder in (work / "exported", converted):
        assert {
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
        } <= set(os.listdir(folder))
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        assert type(hf).__name__ == type(run["model"]).__name__
        with torch.no_grad():
            torch.testing.assert_close(hf(ids).logits, expected, rtol=1e-5, atol=1e-5)
    # The weights moved away from the starting point: the export is the trained model.
    assert not torch.equal(
        saved["model.layers.0.mlp.up_proj.weight"],
        run["model"].state_dict()["model.layers.0.mlp.up_proj.weight"],
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(converted)
    assert tokenizer.decode(tokenizer("the cat sat")["input_ids"]).strip() == "the cat sat"


def test_to_hf_bfloat16(run, tmp_path):
    out = tmp_path / "bf16"
    assert (
        convert.main(
            ["--load", str(run["work"] / "ckpt"), "--to-hf", str(out), "--dtype", "bfloat16"]
        )
        == 0
    )
    config = json.loads((out / "config.json").read_text())
    assert (
        config["torch_dtype"] == "bfloat16"
        and config["eos_token_id"] == run["model"].config.eos_token_id
    )
    tensors = _all_tensors(out)
    fp32 = _all_tensors(run["work"] / "exported")
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    for key, tensor in tensors.items():
        assert torch.equal(tensor, fp32[key].to(torch.bfloat16)), key
    with pytest.raises(SystemExit):  # --dtype belongs to --to-hf
        convert.main(
            [
                "--load",
                str(run["work"] / "ckpt"),
                "--output",
                str(tmp_path / "x.safetensors"),
                "--dtype",
                "bfloat16",
            ]
        )
