"""PEFT's LoRA on models split by tpcore.hf, against PEFT on the dense model in the same job:
the losses of a few SGD steps and the adapters they end with; adapters saved by
tpcore.hf.save_pretrained load in PEFT, and PEFT's load in tpcore.hf (each rank its slices),
with the same logits; LoRA options tpcore does not carry over raise naming them. And
save_pretrained of a split model without adapters gives transformers the dense weights."""

from __future__ import annotations

import copy

import peft
import pytest
import torch
import torch.distributed as dist
import transformers

import tpcore
from checks import assert_close, expect_error, setup_tp
from hf_families import FAMILIES, load_dense, prompt, save_family
from tpcore.tensor_parallel.shard_spec import shard_spec, unshard

STEPS = 3
TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],  # fused q|k|v and gate|up
    "gpt2": ["c_attn", "c_proj", "c_fc"],  # Conv1D, fused q|k|v
}


def _lora_weights(model) -> dict[str, torch.Tensor]:
    """PEFT's names -> whole tensors, from a PeftModel split by tpcore.hf or a dense one."""
    out = {}
    for name, module in model.base_model.model.named_modules():
        if "lora" in module._modules and isinstance(module.lora, tpcore.LoRAAdapter):
            for half in "AB":
                p = getattr(module.lora, half)
                out[f"{name}.lora_{half}"] = unshard(p.detach(), shard_spec(p))
        elif hasattr(module, "lora_A"):
            out[f"{name}.lora_A"] = module.lora_A["default"].weight.detach()
            out[f"{name}.lora_B"] = module.lora_B["default"].weight.detach()
    return out


def _trains_like_peft(rank, world, family, tp, path, saved, peft_saved):
    setup_tp(tp, replicas=True)
    cls = FAMILIES[family][0]
    torch.manual_seed(0)  # PEFT draws A and B (init_lora_weights=False: B too, so B A != 0)
    options = dict(r=4, lora_alpha=8, target_modules=TARGETS[family], init_lora_weights=False)
    if family == "gpt2":
        options["fan_in_fan_out"] = True
    reference = peft.get_peft_model(
        load_dense(path, cls, torch.float32), peft.LoraConfig(**options)
    )
    # A deep copy of the split model trains as the split model does (a copy for DPO or EMA).
    split = copy.deepcopy(tpcore.hf.parallelize(copy.deepcopy(reference)))
    assert isinstance(split, peft.PeftModel)
    trained = [p for p in split.parameters() if p.requires_grad]
    assert len(trained) == len([p for p in reference.parameters() if p.requires_grad])
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (reference, split)]
    ids = prompt(batch=2, seq=9)
    for step in range(STEPS):  # two micro-batches per step: the gradients accumulate
        for micro in (ids[:1], ids[1:]):
            loss_ref = reference(input_ids=micro, labels=micro).loss
            loss = split(input_ids=micro, labels=micro).loss
            assert_close(loss, loss_ref.detach(), f"{family} tp={tp} step {step}: loss")
            loss_ref.backward()
            loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    mine, theirs = _lora_weights(split), _lora_weights(reference)
    assert mine.keys() == theirs.keys() and mine
    for name, value in theirs.items():
        assert_close(mine[name], value, f"{family} tp={tp}: {name} after 3 steps")
    with torch.no_grad():
        logits, logits_ref = (m(input_ids=ids).logits for m in (split, reference))

    # tpcore -> PEFT: the adapters as PEFT saves them, loaded onto the dense base.
    tpcore.hf.save_pretrained(split, saved)
    dist.barrier()
    loaded = peft.PeftModel.from_pretrained(load_dense(path, cls, torch.float32), saved)
    with torch.no_grad():
        assert_close(loaded(input_ids=ids).logits, logits, f"{family}: PEFT loads tpcore's save")
    # PEFT -> tpcore: PEFT's save read onto a split base, each rank its slices.
    if rank == 0:
        reference.save_pretrained(peft_saved)
    dist.barrier()
    base = tpcore.hf.from_pretrained(path, dtype=torch.float32)
    tpcore.hf.load_adapter(base, peft_saved)
    with torch.no_grad():
        assert_close(base(input_ids=ids).logits, logits_ref, f"{family}: tpcore loads PEFT's save")
    return True


@pytest.mark.parametrize(
    "family,tp", [("llama", 2), ("llama", 4), ("phi3", 2), ("phi3", 4), ("gpt2", 2)]
)
def test_split_peft_model_trains_like_peft_and_round_trips(cpu_ranks, tmp_path, family, tp):
    """llama at TP=4 and phi3 at TP=4 copy KV heads over ranks (B's K/V rows summed over the
    copies); phi3 and gpt2 fuse q|k|v (one adapter over the parts)."""
    path = save_family(family, tmp_path / family)
    saved, peft_saved = str(tmp_path / "tpcore_adapter"), str(tmp_path / "peft_adapter")
    assert all(cpu_ranks.run(_trains_like_peft, family, tp, path, saved, peft_saved))


def _refusals(rank, world, path):
    setup_tp(2, replicas=True)
    cls = FAMILIES["llama"][0]

    def split(**options):
        torch.manual_seed(0)
        model = load_dense(path, cls, torch.float32)
        config = peft.LoraConfig(**{"r": 4, "target_modules": ["q_proj"], **options})
        tpcore.hf.parallelize(peft.get_peft_model(model, config))

    expect_error(
        ValueError, "LoraConfig(use_dora=True) is not supported (DoRA", split, use_dora=True
    )
    expect_error(
        ValueError,
        "LoraConfig(modules_to_save=['lm_head']) is not supported",
        split,
        modules_to_save=["lm_head"],
    )
    expect_error(
        ValueError,
        "PEFT's LoRA Embedding on model.embed_tokens is not supported",
        split,
        target_modules=["embed_tokens"],
    )
    expect_error(
        ValueError,
        "LoRA on lm_head is not supported: tpcore.hf makes it a VocabParallelLMHead",
        split,
        target_modules=["lm_head"],
    )
    model = load_dense(path, cls, torch.float32)
    ia3 = peft.get_peft_model(
        model, peft.IA3Config(target_modules=["k_proj"], feedforward_modules=[])
    )
    expect_error(ValueError, "PEFT's IA3 is not supported", tpcore.hf.parallelize, ia3)
    # A split that fails after PEFT's layers were taken out puts them back: the model is as
    # it was, and computes what it did.
    from tpcore.hf.tensor_parallel import parallelize as module

    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)
    model = peft.get_peft_model(load_dense(path, cls, torch.float32), config)
    before = model(input_ids=prompt()).logits
    make_plan = module.make_plan

    def failing_plan(*args):
        raise ValueError("no plan today")

    module.make_plan = failing_plan
    try:
        expect_error(ValueError, "no plan today", tpcore.hf.parallelize, model)
    finally:
        module.make_plan = make_plan
    assert type(model.base_model.model.model.layers[0].self_attn.q_proj).__name__ == "Linear"
    assert hasattr(model.base_model.model.model.layers[0].self_attn.q_proj, "lora_A")
    assert torch.equal(model(input_ids=prompt()).logits, before)
    return True


def test_peft_options_tpcore_does_not_carry_over_raise(cpu_ranks, tmp_path):
    path = save_family("llama", tmp_path / "llama")
    assert all(cpu_ranks.run(_refusals, path))


def _saves_whole(rank, world, family, tp, path, out):
    setup_tp(tp, replicas=True)
    cls = FAMILIES[family][0]
    dense = load_dense(path, cls, torch.float32)
    split = tpcore.hf.parallelize(copy.deepcopy(dense))
    assert tpcore.hf.save_pretrained(split, out) == out
    dist.barrier()
    again = getattr(transformers, cls).from_pretrained(out).eval()
    expected = dense.state_dict()
    for name, value in again.state_dict().items():
        assert torch.equal(value, expected[name]), f"{family}: {name}"
    return True


@pytest.mark.parametrize("family", ["llama", "phi3", "gpt2", "qwen3", "mixtral"])
def test_save_pretrained_writes_the_dense_model(cpu_ranks, tmp_path, family):
    """Column and row weights, padded vocabularies, GPT-2's transposed Conv1D and tied head,
    Qwen3's split q / k norms, Mixtral's experts: transformers reads back the dense weights."""
    path = save_family(family, tmp_path / family)
    assert all(cpu_ranks.run(_saves_whole, family, 4, path, str(tmp_path / "saved")))
