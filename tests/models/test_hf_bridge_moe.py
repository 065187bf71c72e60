"""Hugging Face mixture-of-experts models into GPTModel and back, against transformers
computed in this test.

Tiny random Mixtral (every layer routed), Qwen3-MoE (q / k norms, layer 1 dense through
`mlp_only_layers`, top-k weights left unnormalised), Qwen2-MoE (q/k/v biases, a gated
shared expert) and OLMoE (q / k norms over the whole projection, split over TP) are saved
with `save_pretrained` (one tensor per expert) and as transformers 5 holds them (fused
`gate_up_proj` / `down_proj`), loaded into GPTModel at TP x EP = 1 x 1,
2 x 1, 1 x 2 and 2 x 2 on 4 spawned ranks: the logits equal transformers' in fp32 (and
Qwen3-MoE's balancing loss, its coefficient converted, equals transformers'). Exported back
at each layout, the files hold bitwise the tensors `save_pretrained` wrote and transformers
loads them into the same state dict. One MoE block of GPTModel's dense reference equals
transformers' sparse MoE blocks with the same weights. Configs transformers has that
GPTModel does not compute exactly are refused naming the option, and a folder with another
number of experts than the model raises naming both numbers, on every rank alike.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch

from checks import assert_close
from tpcore.hf.gpt_bridge import config_from_hf, config_to_hf
from tpcore.models import GPTConfig

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

VOCAB, BATCH, SEQ = 61, 2, 7
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (TP, EP) on 4 ranks
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
    output_router_logits=True,
    router_aux_loss_coef=0.02,
)


def _hf_config(family: str):
    if family == "mixtral":
        return transformers.MixtralConfig(
            **_COMMON, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2
        )
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    if family == "olmoe":  # experts intermediate_size wide, top-k weights unnormalised
        return transformers.OlmoeConfig(
            **_COMMON, intermediate_size=24, num_experts=4, num_experts_per_tok=2
        )
    if family == "qwen3_moe":  # a dense layer 48 wide after the MoE one
        return transformers.Qwen3MoeConfig(
            **_COMMON, **moe, intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False
        )
    return transformers.Qwen2MoeConfig(  # a shared expert 24 wide beside the routed ones
        **_COMMON, **moe, intermediate_size=48, shared_expert_intermediate_size=24
    )


def _hf_model(family: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        _hf_config(family), attn_implementation="eager"
    ).eval()
    with torch.no_grad():  # no constant left (unit norms, zero routers): every slice shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "qwen2_moe", "olmoe"])
def moe_case(request, tmp_path_factory):
    """(family, save_pretrained folder, fused folder, ids, transformers' logits and
    unscaled balancing loss, the model's state dict)."""
    family = request.param
    model = _hf_model(family)
    folder = tmp_path_factory.mktemp(family)
    model.save_pretrained(folder)
    # transformers 5's own layout: the module's state dict (fused experts, `mlp.gate`).
    fused = tmp_path_factory.mktemp(f"{family}_fused")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state), sorted(state)
    safetensors.save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(folder / "config.json", fused / "config.json")
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(input_ids=ids)
    return family, str(folder), str(fused), ids, out.logits, out.aux_loss, state


def _load_job(rank, world, folders, ids, expected, aux_loss, out_dir):
    import torch.distributed as dist

    import tpcore
    from tpcore import comm, parallel_state
    from tpcore.hf.gpt_bridge import export_hf, load_hf_weights
    from tpcore.models import GPTModel

    source = json.load(open(os.path.join(folders[0], "config.json")))
    done = []
    for tp, ep in LAYOUTS:
        parallel_state.destroy_model_parallel()
        tpcore.initialize_model_parallel(tp, expert_model_parallel_size=ep)
        tp_group = parallel_state.get_tensor_model_parallel_group()
        # A vocabulary of 61 padded to a multiple of 2 x TP: padding rows on the last rank.
        config = config_from_hf(folders[0], make_vocab_size_divisible_by=2)
        for folder in folders:  # one tensor per expert, then fused
            model = GPTModel(config, _init=False).eval()
            load_hf_weights(model, folder)
            with torch.no_grad():
                logits = comm.all_gather(model(ids).contiguous(), -1, tp_group)[..., :VOCAB]
            what = f"TP {tp} EP {ep} {os.path.basename(folder)}"
            assert_close(logits, expected, f"{what} logits")
            if config.num_layers == 2 and config.moe_layer_freq == [1, 0]:
                # One MoE layer: its balancing loss (this rank's share of it, summed over the
                # ranks that split its tokens) is transformers', times the coefficient.
                share = model.moe_layers()[0].last_routing["aux_loss"].clone()
                dist.all_reduce(share, group=tp_group)
                assert_close(share, aux_loss * source["router_aux_loss_coef"], f"{what} aux")
        export_hf(model, os.path.join(out_dir, f"tp{tp}_ep{ep}"), hf_config=source)
        done.append((tp, ep))
    return done


def test_moe_hf_into_gptmodel_and_back(cpu_ranks, moe_case, tmp_path):
    family, folder, fused, ids, logits, aux_loss, state = moe_case
    out = str(tmp_path)
    results = cpu_ranks.run(_load_job, [folder, fused], ids, logits, aux_loss, out, timeout=300)
    assert results == [LAYOUTS] * cpu_ranks.world
    original = safetensors.load_file(os.path.join(folder, "model.safetensors"))
    for tp, ep in LAYOUTS:  # what save_pretrained wrote, bit for bit, under its names
        exported = safetensors.load_file(os.path.join(out, f"tp{tp}_ep{ep}", "model.safetensors"))
        assert exported.keys() == original.keys(), (tp, ep)
        for key, tensor in original.items():
            assert torch.equal(exported[key], tensor), (tp, ep, key)
    back = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(out, "tp2_ep2")).eval()
    architecture = json.load(open(os.path.join(folder, "config.json")))["architectures"][0]
    assert type(back).__name__ == architecture
    loaded = back.state_dict()
    assert loaded.keys() == state.keys()
    for key, tensor in state.items():
        assert torch.equal(loaded[key], tensor), key
    assert back.config.router_aux_loss_coef == pytest.approx(0.02)


def _copy_block(ours, theirs) -> None:
    """`theirs`' weights (a transformers sparse MoE block) into `ours` (a ReferenceMoE)."""
    with torch.no_grad():
        ours.router.weight.copy_(theirs.gate.weight)
        ours.experts.fc1.weight.copy_(theirs.experts.gate_up_proj)
        ours.experts.fc2.weight.copy_(theirs.experts.down_proj)
        if hasattr(theirs, "shared_expert"):
            shared = theirs.shared_expert
            fc1 = torch.cat([shared.gate_proj.weight, shared.up_proj.weight])
            ours.shared_expert.fc1.weight.copy_(fc1)
            ours.shared_expert.fc2.weight.copy_(shared.down_proj.weight)
            ours.shared_expert_gate.weight.copy_(theirs.shared_expert_gate.weight)


@pytest.mark.parametrize(
    "family,block",
    [
        ("mixtral", "mixtral.modeling_mixtral.MixtralSparseMoeBlock"),
        ("qwen3_moe", "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"),
        ("qwen2_moe", "qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock"),
        ("olmoe", "olmoe.modeling_olmoe.OlmoeSparseMoeBlock"),
    ],
)
def test_reference_moe_block_equals_transformers(family, block):
    """GPTModel's dense reference MoE (ReferenceGPT's layer 0, dropless) against
    transformers' block with the same weights: routing, experts and the shared expert."""
    import importlib

    from tpcore.models import ReferenceGPT
    from tpcore.moe import ReferenceMoE

    hf_config = _hf_config(family)
    module, cls = block.rsplit(".", 1)
    torch.manual_seed(0)
    theirs = getattr(importlib.import_module(f"transformers.models.{module}"), cls)(hf_config)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.3)
    config = config_from_hf(hf_config)
    ours = ReferenceGPT(config).layers[0].mlp
    assert isinstance(ours, ReferenceMoE)
    _copy_block(ours, theirs)
    x = torch.randn(3, 5, hf_config.hidden_size)  # [b, s, h]
    with torch.no_grad():
        want = theirs(x)
        got = ours(x.transpose(0, 1)).transpose(0, 1)
    assert_close(got, want, f"{family} block")


def test_moe_configs_round_trip_and_refusals():
    """config_to_hf(config_from_hf(x)) describes the same model; the balancing coefficient is
    k times transformers' where transformers adds the loss, 0 where it does not; OLMoE's
    clip_qkv, router jitter and shapes no family has are refused naming the option."""
    for family in ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe"):
        hf = _hf_config(family).to_dict()
        config = config_from_hf(hf)
        assert config.moe_aux_loss_coeff == pytest.approx(0.02 * 2)
        out = config_to_hf(config, hf)
        assert out["model_type"] == family and config_from_hf(out) == config
        assert out["router_aux_loss_coef"] == pytest.approx(0.02)
        silent = config_from_hf({**hf, "output_router_logits": False})
        assert silent.moe_aux_loss_coeff == 0.0
        assert config_to_hf(silent, hf)["output_router_logits"] is False
    qwen3 = config_from_hf(_hf_config("qwen3_moe"))
    assert qwen3.moe_layer_freq == [1, 0] and not qwen3.moe_norm_topk_prob and qwen3.qk_norm
    assert config_to_hf(qwen3)["mlp_only_layers"] == [1]
    sparse_step = {
        **_hf_config("qwen3_moe").to_dict(),
        "mlp_only_layers": [],
        "decoder_sparse_step": 2,
    }
    assert config_from_hf(sparse_step).moe_layer_freq == [0, 1]  # transformers' (i + 1) % step

    olmoe = config_from_hf(_hf_config("olmoe"))
    assert olmoe.qk_norm and olmoe.qk_norm_scope == "projection" and not olmoe.moe_norm_topk_prob
    clipped = {**_hf_config("olmoe").to_dict(), "clip_qkv": 8.0}
    with pytest.raises(ValueError, match="olmoe option clip_qkv=8.0"):
        config_from_hf(clipped)
    base = dataclasses.asdict(olmoe)
    dense = {k: v for k, v in base.items() if not k.startswith("moe_")}
    for fields, words in [
        (
            {**base, "moe_layer_freq": [1, 0]},
            "olmoe (the MoE family of this shape): it has no dense",
        ),
        ({**base, "moe_shared_expert_intermediate_size": 8}, "no shared expert"),
        ({**dense, "num_experts": None}, "no dense Hugging Face family GPTModel exports"),
    ]:
        with pytest.raises(ValueError) as e:
            config_to_hf(GPTConfig(**fields))
        assert words in str(e.value), str(e.value)
    jitter = {**_hf_config("mixtral").to_dict(), "router_jitter_noise": 0.1}
    with pytest.raises(ValueError, match="mixtral option router_jitter_noise=0.1"):
        config_from_hf(jitter)
    mixtral = config_from_hf(_hf_config("mixtral"))
    for change, words in [
        (dict(moe_router_score_function="sigmoid"), "moe_router_score_function 'sigmoid'"),
        (dict(moe_norm_topk_prob=False), "top-k weights left unnormalised"),
        (dict(moe_layer_freq=[1, 0]), "dense layers (moe_layer_freq [1, 0]"),
        (dict(moe_shared_expert_intermediate_size=8), "qwen2_moe (the MoE family"),
    ]:
        with pytest.raises(ValueError) as e:
            config_to_hf(dataclasses.replace(mixtral, **change))
        assert words in str(e.value), str(e.value)


def _wrong_experts_job(rank, world, cases):
    import torch.distributed as dist

    import tpcore
    from tpcore.hf.gpt_bridge import load_hf_weights
    from tpcore.models import GPTModel

    tpcore.initialize_model_parallel(2, expert_model_parallel_size=2)
    messages = []
    for folder, model_experts, words in cases:
        config = config_from_hf(folder, **({"num_experts": model_experts} if model_experts else {}))
        try:
            load_hf_weights(GPTModel(config, _init=False), folder)
        except ValueError as e:
            assert all(w in str(e) for w in words), f"rank {rank}: expected {words} in: {e}"
            messages.append(str(e))
        else:
            raise AssertionError(f"rank {rank}: {folder} loaded")
    total = torch.ones(1)
    dist.all_reduce(total)  # every rank raised before any collective: still in step
    assert total.item() == world
    return messages


def test_another_number_of_experts_raises_naming_both(cpu_ranks, tmp_path):
    """A model of 8 experts meets a folder of 4; a folder whose config.json says 8 holds
    the tensors of 4 (per expert, and fused)."""
    model = _hf_model("mixtral")
    model.save_pretrained(tmp_path / "four")
    fused = tmp_path / "fused"
    fused.mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    safetensors.save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    shutil.copytree(tmp_path / "four", tmp_path / "good")
    config = json.load(open(tmp_path / "four" / "config.json"))
    for folder in (tmp_path / "four", fused):
        json.dump({**config, "num_local_experts": 8}, open(folder / "config.json", "w"))
    cases = [
        (
            str(tmp_path / "good"),
            8,
            ["does not describe this model", "num_experts: folder 4, model 8"],
        ),
        (str(tmp_path / "four"), None, ["holds 4 experts in layer 0", "the config gives 8"]),
        (
            str(fused),
            None,
            ["'model.layers.0.mlp.experts.gate_up_proj'", "holds 4 experts", "gives 8"],
        ),
    ]
    messages = cpu_ranks.run(_wrong_experts_job, cases, timeout=120)
    assert all(m == messages[0] for m in messages) and len(messages[0]) == len(cases)
