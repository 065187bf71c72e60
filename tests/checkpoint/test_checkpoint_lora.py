"""Checkpoints of LoRA runs (adapters trained, every other weight frozen) read back whole.

1. An MoE GPT with adapters on its attention (its experts frozen) is saved at TP x EP 2 x 2 in
   tpcore's torch format, with the plain and the distributed optimizer, and loaded at TP x EP
   1 x 2 into a fresh adapted model: every parameter (adapters, experts, the rest) equals this
   rank's slice of the saved model's full tensor, and only the adapters have AdamW state;
   `load_dense_state_dict` gives the saved model's `to_dense()` (adapters merged). Before,
   the loaders looked for the frozen experts' optimizer state and refused the checkpoint.
2. A Llama-shaped GPT with adapters on every layer, saved at TP 2 in both formats:
   `checkpoint_to_hf` writes a folder whose logits in transformers are the adapted model's
   (`to_dense()`), not the base's. Before, the torch format refused the adapter tensors and
   torch_dist silently wrote the base weights without the adapters.
"""

from __future__ import annotations

import os

import pytest
import torch

import tpcore
from checks import GPT_VARIANTS, MOE_GPT, assert_close
from tpcore import parallel_state
from tpcore.models import GPTModel, ReferenceGPT
from tpcore.tensor_parallel.shard_spec import shard, shard_spec, unshard
from tpcore.train import load_checkpoint, load_dense_state_dict, save_checkpoint
from train_checks import adamw_steps, make_optimizer_for

LLAMA = GPT_VARIANTS["llama"]


def _lora_meta(targets: list[str]) -> dict:  # what the trainer records (`lora_settings`)
    return {
        "rank": 2,
        "alpha": 4.0,
        "dropout": 0.0,
        "use_rslora": False,
        "target_modules": targets,
        "base": None,
    }


def _setup(config, targets, tp: int, ep: int, seed: int, distributed: bool):
    parallel_state.destroy_model_parallel()
    tpcore.initialize_model_parallel(tp, expert_model_parallel_size=ep)
    torch.manual_seed(seed)
    model = GPTModel(config)
    base = model.to_dense().state_dict()
    tpcore.add_lora(model, rank=2, alpha=4.0, target_modules=targets)
    opt, grads = make_optimizer_for(model, distributed)
    groups = dict(
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        dp_group=parallel_state.get_data_parallel_group(),
    )
    return model, opt, grads, groups, base


def _train_and_save(rank, world, folder, config, targets, tp, ep, distributed, ckpt_format):
    model, opt, grads, groups, base = _setup(config, targets, tp, ep, 0, distributed)
    adamw_steps(model, opt, grads)
    save_checkpoint(
        folder,
        2,
        model,
        opt,
        consumed_samples=4,
        **groups,
        extra={"lora": _lora_meta(targets)},
        ckpt_format=ckpt_format,
    )
    full = {n: unshard(p.detach(), shard_spec(p)) for n, p in model.named_parameters()}
    merged = model.to_dense().state_dict()
    if rank == 0:
        torch.save({"full": full, "merged": merged, "base": base}, folder + "_saved.pt")
    return True


def _load_moe(rank, world, folder, distributed):
    targets = ["qkv", "proj"]
    model, opt, _, groups, _ = _setup(MOE_GPT, targets, 1, 2, 5, distributed)
    load_checkpoint(os.path.join(folder, "iter_0000002"), model, opt, tp_group=groups["tp_group"])
    full = torch.load(folder + "_saved.pt")["full"]
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), shard(full[name], shard_spec(p))), name
    state = opt.state_dict()
    with_state = set(state["shards"] if distributed else state["params"])
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora." in n for n in adapters)
    assert with_state <= adapters and (distributed or with_state == adapters), with_state
    return True


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed_optimizer"])
def test_lora_checkpoint_of_an_moe_gpt_loads_at_another_layout(cpu_ranks, tmp_path, distributed):
    folder = str(tmp_path / "lora_moe")
    targets = ["qkv", "proj"]
    cpu_ranks.run(_train_and_save, folder, MOE_GPT, targets, 2, 2, distributed, "torch")
    assert all(cpu_ranks.run(_load_moe, folder, distributed))
    config, state = load_dense_state_dict(folder)
    merged = torch.load(folder + "_saved.pt")["merged"]
    assert state.keys() == merged.keys()
    for name, tensor in merged.items():
        assert_close(state[name], tensor, name)


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_hf_export_of_a_lora_checkpoint_holds_the_adapters(cpu_ranks, tmp_path, ckpt_format):
    transformers = pytest.importorskip("transformers")
    from tpcore.hf.gpt_bridge.checkpoint import checkpoint_to_hf

    folder = str(tmp_path / "lora")
    targets = ["qkv", "proj", "fc1", "fc2"]
    cpu_ranks.run(_train_and_save, folder, LLAMA, targets, 2, 1, False, ckpt_format)
    saved = torch.load(folder + "_saved.pt")
    out = checkpoint_to_hf(folder, str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    adapted, base = ReferenceGPT(LLAMA), ReferenceGPT(LLAMA)
    adapted.load_state_dict(saved["merged"])
    base.load_state_dict(saved["base"])
    ids = torch.randint(0, LLAMA.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want, unadapted = hf(input_ids=ids).logits, adapted(ids), base(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (want - unadapted).abs().max() > 1e-3  # the adapters changed the model
