"""LoRA in the trainer (`--lora-rank`): adapters fine-tune a pretraining checkpoint's weights,
on the same curve at TP=1 and TP=2, resumed at another layout with the distributed optimizer;
the checkpoints record the adapters and their base; tpcore-convert merges them; a LoRA
checkpoint resumed without its flags is refused on every rank. From a Hugging Face model
(`--load-hf`), `--save-peft` writes adapters that PEFT applies to that model with the logits
of `--save-hf`'s merged export."""

from __future__ import annotations

import json

import pytest
import torch
from hf_train_data import hf_model_and_data

from launch import torchrun
from tpcore.train import export_safetensors, load_dense_gpt
from train_runs import (  # noqa: F401 (fixtures)
    FLAGS,
    RUN_TIMEOUT_S,
    SCRIPT,
    assert_same_curves,
    train,
    workdir,
)

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2"]


@pytest.fixture(scope="module")
def base(workdir):
    """A pretraining checkpoint after 20 steps: the base the adapters fine-tune."""
    save = workdir / "base"
    train(workdir, "base", 1, "--save", str(save), "--save-interval", "20", "--exit-interval", "20")
    return save / "iter_0000020"


@pytest.fixture(scope="module")
def lora_tp2(workdir, base):
    save = workdir / "lora_tp2"
    rows, stdout = train(
        workdir,
        "lora_tp2",
        2,
        "--tensor-parallel-size",
        "2",
        *LORA,
        "--load",
        str(base),
        "--save",
        str(save),
        "--save-interval",
        "10",
        "--exit-interval",
        "20",
    )
    return rows, stdout, save


def test_lora_finetunes_alike_at_tp1_and_tp2_and_resumes_elsewhere(workdir, base, lora_tp2):
    rows, stdout, save = lora_tp2
    assert f"fine-tuning the weights of checkpoint {base}" in stdout
    assert "LoRA rank 4 on qkv,proj,fc1,fc2" in stdout
    assert rows[-1]["loss"] < rows[0]["loss"], [r["loss"] for r in rows]
    meta = json.loads((save / "iter_0000020" / "metadata.json").read_text())
    lora = meta["lora"]
    assert (lora["rank"], lora["alpha"], lora["target_modules"]) == (
        4,
        8.0,
        ["qkv", "proj", "fc1", "fc2"],
    )
    assert lora["base"]["checkpoint"] == str(base) and lora["base"]["iteration"] == 20
    # TP=1 follows the TP=2 curve for 10 steps; DP=2 with the distributed optimizer resumes its
    # checkpoint and follows the TP=2 curve's next 10 steps.
    tp1, _ = train(
        workdir, "lora_tp1", 1, *LORA, "--load", str(base), "--save", str(workdir / "lora_tp1"),
        "--save-interval", "10", "--exit-interval", "10",
    )  # fmt: skip
    assert_same_curves(tp1, rows[:10], exact=False)
    # At TP=1, as the base: only the adapters have optimizer state; the base weights are the
    # base checkpoint's, unchanged.
    shard = torch.load(
        workdir / "lora_tp1" / "iter_0000010" / "model_tp00_pp00.pt", weights_only=True
    )
    base_shard = torch.load(base / "model_tp00_pp00.pt", weights_only=True)
    assert set(shard["optimizer"]["params"]) == {n for n in shard["model"] if ".lora." in n}
    adapted = {n for n in shard["model"] if ".lora." in n}
    assert len(adapted) == 2 * 4 * 2  # A and B of 4 layers in 2 blocks
    base_weights = {n for n in shard["model"] if ".lora." not in n}
    assert base_weights == set(base_shard["model"])
    assert all(torch.equal(shard["model"][n], base_shard["model"][n]) for n in base_weights)

    dp2, stdout = train(
        workdir, "lora_dp2", 2, *LORA, "--use-distributed-optimizer", "--load",
        str(workdir / "lora_tp1"), "--exit-interval", "10",
    )  # fmt: skip
    assert "resumed from" in stdout and "at iteration 10" in stdout
    assert_same_curves(dp2[-10:], rows[10:20], exact=False)


def test_convert_merges_the_adapters(lora_tp2, base, tmp_path):
    pytest.importorskip("safetensors")  # tpcore-convert's optional dependency
    _, _, save = lora_tp2
    merged, _ = load_dense_gpt(
        export_safetensors(str(save / "iter_0000020"), str(tmp_path / "lora.safetensors"))
    )
    plain, _ = load_dense_gpt(export_safetensors(str(base), str(tmp_path / "base.safetensors")))
    merged_state, plain_state = merged.state_dict(), plain.state_dict()
    assert merged_state.keys() == plain_state.keys()  # no adapter tensors: they are merged
    for name, value in plain_state.items():
        adapted = name.endswith(("qkv.weight", "proj.weight", "fc1.weight", "fc2.weight"))
        assert torch.equal(merged_state[name], value) != adapted, name


def test_a_lora_checkpoint_needs_its_adapters(workdir, lora_tp2):
    """Resumed without --lora-rank, or with another rank, a LoRA checkpoint is refused on every
    rank, naming the flags it was trained with."""
    _, _, save = lora_tp2
    for extra, message in (
        ([], "holds LoRA adapters (rank 4, alpha 8 on qkv,proj,fc1,fc2); resume it with "
             "--lora-rank 4 --lora-alpha 8"),
        (["--lora-rank", "2"], "holds other LoRA adapters (rank 4, alpha 8 on qkv,proj,fc1,fc2):"
                               " rank: checkpoint 4, flags 2"),
    ):  # fmt: skip
        flags = FLAGS + ["--data-path", str(workdir / "corpus"), "--tensor-parallel-size", "2"]
        proc = torchrun([SCRIPT, *flags, "--load", str(save), *extra], 2, timeout=RUN_TIMEOUT_S)
        assert proc.returncode != 0
        assert proc.stderr.count(message) >= 2, proc.stderr[-2000:]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_save_peft_gives_peft_the_merged_models_logits(tmp_path, family):
    """Llama's separate q / k / v and gate / up projections take GPTModel's per-part adapters
    one each; GPT-2's fused c_attn takes them as one block-diagonal adapter of rank 3 r."""
    import peft

    folder, base = hf_model_and_data(tmp_path, family)
    data = str(tmp_path / "data" / "docs")
    flags = ["-m", "tpcore.train", "--load-hf", str(folder), "--data-path", data,
             "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--train-iters", "4", "--eval-iters", "0", "--lr", "1e-2", "--log-interval", "1",
             "--tensor-parallel-size", "2", "--device", "cpu", "--no-progress", *LORA[:4],
             "--save-peft", str(tmp_path / "adapter"),
             "--save-hf", str(tmp_path / "merged")]  # fmt: skip
    proc = torchrun(flags, 2, cwd=tmp_path, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    expected = (
        ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
        if family == "llama"
        else ["c_attn", "c_fc", "c_proj"]
    )
    assert settings["target_modules"] == expected
    ids = torch.randint(
        0, base.config.vocab_size - 5, (2, 12), generator=torch.Generator().manual_seed(3)
    )
    cls = type(base)
    merged = cls.from_pretrained(tmp_path / "merged").eval()
    adapted = peft.PeftModel.from_pretrained(
        cls.from_pretrained(folder), tmp_path / "adapter"
    ).eval()
    with torch.no_grad():
        want, got, plain = (m(input_ids=ids).logits for m in (merged, adapted, base))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (want - plain).abs().max() > 1e-3  # the adapters changed the model
