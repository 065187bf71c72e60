"""MoE pretraining through the CLI (Megatron's flags): the loss curve at EP 2 (also with the
distributed optimizer, overlapped), at TP 2 x EP 2 with sequence parallelism, and at PP 2 x
EP 2 equals EP 1's (same global batch), with the
balancing and z losses and the expert loads in metrics.csv; MoE flags the run cannot honour
raise before training; a checkpoint saved at EP 2 resumes at EP 1 (either format)."""

from __future__ import annotations

import math

import pytest

from launch import torchrun
from tpcore.train import parse_args
from train_runs import (  # noqa: F401 (workdir: a fixture)
    FLAGS,
    RUN_TIMEOUT_S,
    SCRIPT,
    assert_same_curves,
    train,
    workdir,
)

MOE = [
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-aux-loss-coeff",
    "0.01",
    "--moe-z-loss-coeff",
    "0.001",
    "--moe-layer-freq",
    "([0]*1+[1]*1)",
    "--activation",
    "swiglu",
    "--train-iters",
    "30",
    "--eval-interval",
    "15",
]


@pytest.fixture(scope="module")
def ep1_run(workdir):  # noqa: F811
    return train(workdir, "moe_ep1", 2, *MOE)


@pytest.mark.parametrize(
    "name,nproc,flags",
    [
        ("ep2", 2, ["--expert-model-parallel-size", "2"]),
        (
            "ep2_distributed_optimizer",
            2,
            [
                "--expert-model-parallel-size",
                "2",
                "--use-distributed-optimizer",
                "--overlap-grad-reduce",
                "--overlap-param-gather",
            ],
        ),
        (
            "tp2_sp_ep2",
            4,
            [
                "--tensor-parallel-size",
                "2",
                "--sequence-parallel",
                "--expert-model-parallel-size",
                "2",
                "--moe-token-dispatcher-type",
                "allgather",
            ],
        ),
        (
            "pp2_ep2",
            4,
            ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"],
        ),
    ],
)
def test_expert_parallel_curves_equal_ep1(workdir, ep1_run, name, nproc, flags):  # noqa: F811
    rows, out = train(workdir, f"moe_{name}", nproc, *MOE, *flags)
    assert_same_curves(ep1_run[0], rows, exact=False)
    for key in ("moe_aux_loss", "moe_z_loss", "moe_load_max_over_mean"):
        ours = [r[key] for r in rows]
        theirs = [r[key] for r in ep1_run[0]]
        assert all(math.isfinite(v) and v > 0 for v in ours), f"{key}: {ours}"
        assert ours == pytest.approx(theirs, rel=1e-5), key
    # Balancing at coefficient 0.01: E * sum f P is about 1 for an even router.
    assert 0.005 < rows[-1]["moe_aux_loss"] < 0.03
    assert "MoE 4 experts, top-2, EP 2" in out


@pytest.mark.parametrize(
    "ckpt_format,nproc,saved_with,resumed_with",
    [
        ("torch_dist", 2, ["--use-distributed-optimizer"], []),
        (
            "torch",
            4,
            ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"],
            ["--use-distributed-optimizer"],
        ),
    ],
)
def test_checkpoint_at_ep2_resumes_at_ep1(
    workdir,  # noqa: F811
    ep1_run,
    ckpt_format,
    nproc,
    saved_with,
    resumed_with,
):
    """Saved halfway at EP 2, resumed at EP 1 on 2 ranks: the curve of the uninterrupted EP 1
    run. In torch_dist with the distributed optimizer (its slices of the 3-D expert weights),
    resumed without it; in tpcore's torch format (the experts' own files and their optimizer
    slice files, those of the stage holding the MoE layer) saved at PP 2 x EP 2 with the
    distributed optimizer, resumed at PP 1 with it (slices over another group). A model with
    another number of experts refuses the checkpoint, naming both."""
    save = str(workdir / f"moe_ckpt_{ckpt_format}")
    ckpt = ["--save", save, "--save-interval", "15", "--ckpt-format", ckpt_format]
    train(
        workdir,
        f"moe_resume_{ckpt_format}",
        nproc,
        *MOE,
        *ckpt,
        "--expert-model-parallel-size",
        "2",
        *saved_with,
        "--exit-interval",
        "15",
    )
    rows, out = train(workdir, f"moe_resume_{ckpt_format}", 2, *MOE, "--load", save, *resumed_with)
    assert "resumed from" in out
    assert_same_curves(ep1_run[0], rows, exact=False)
    if ckpt_format == "torch":
        return
    other = [f if f != "4" else "8" for f in MOE]  # --num-experts 8
    proc = torchrun(
        [SCRIPT, *FLAGS, *other, "--data-path", str(workdir / "corpus"), "--load", save],
        2,
        timeout=RUN_TIMEOUT_S,
    )
    assert proc.returncode != 0
    assert "num_experts: checkpoint 4, model 8" in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--moe-router-topk", "4"], "--moe-router-topk need(s) --num-experts"),
        (
            ["--expert-model-parallel-size", "2"],
            "--expert-model-parallel-size 2 needs --num-experts",
        ),
        (
            ["--num-experts", "6", "--expert-model-parallel-size", "4"],
            "--num-experts 6 is not divisible",
        ),
        (
            ["--num-experts", "4", "--moe-router-topk", "5"],
            "moe_router_topk (5) exceeds num_experts",
        ),
        (["--num-experts", "4", "--moe-layer-freq", "[1]*1000000000"], "--moe-layer-freq must be"),
        (["--num-experts", "4", "--moe-aux-loss-coeff", "-1"], "--moe-aux-loss-coeff"),
        (
            ["--num-experts", "4", "--lora-rank", "4"],
            "--lora-target-modules fc1,fc2 with mixture-of-experts layers: LoRA adapters on "
            "expert weights are not supported yet",
        ),
    ],
)
def test_bad_moe_flags_raise(flags, match):
    with pytest.raises(
        ValueError,
        match=match.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("*", r"\*"),
    ):
        parse_args(["--data-path", "x", *flags])


def test_mixtral_from_hf_at_ep2_and_back(tmp_path):
    """--load-hf of a Mixtral at EP 2: the first step's loss is transformers' on the same
    batch, the balancing coefficient is the folder's (x top-k), and --save-hf gives a folder
    transformers loads as a Mixtral, holding the trained weights."""
    import torch
    import transformers
    from hf_train_data import hf_model_and_data

    from tpcore.data import GPTDataset, IndexedDataset
    from tpcore.train import read_metrics

    folder, model = hf_model_and_data(tmp_path, "mixtral")
    out = tmp_path / "out"
    proc = torchrun(
        ["-m", "tpcore.train", "--load-hf", str(folder), "--data-path",
         str(tmp_path / "data" / "docs"), "--seq-length", "16", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--train-iters", "4", "--eval-iters", "0", "--lr", "3e-3",
         "--lr-warmup-iters", "0", "--log-interval", "1", "--device", "cpu", "--no-progress",
         "--expert-model-parallel-size", "2", "--log-dir", str(out), "--save-hf",
         str(tmp_path / "exported"), "--seed", "1234"],
        2,
        cwd=tmp_path,
        timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    rows = read_metrics(str(out / "metrics.csv"))
    dataset = GPTDataset(
        IndexedDataset(str(tmp_path / "data" / "docs")), 16, 16, split="train",
        valid_fraction=0.05, seed=1234,
    )  # fmt: skip
    batch = torch.stack([dataset[i] for i in range(4)])
    with torch.no_grad():
        logits = model(input_ids=batch).logits
        expected = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
        ).item()
    assert rows[0]["loss"] == pytest.approx(expected, rel=1e-5)
    assert rows[0]["moe_aux_loss"] > 0.5 * 0.02 * 2 * 2  # 2 layers, coefficient 0.02 x top-2
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    assert isinstance(exported, transformers.MixtralForCausalLM)
    with torch.no_grad():
        after = exported(input_ids=batch).logits
    assert torch.isfinite(after).all() and not torch.equal(after, logits)  # trained, not copied
