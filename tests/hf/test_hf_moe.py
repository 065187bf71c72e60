"""tpcore.hf on sparse MoE models, beyond the family tests of test_hf.py (which compare
Mixtral, Qwen3-MoE and OLMoE with the dense model at TP 1, 2 and 4, forward, generation and
backward): reading fused experts from checkpoints stored expert by expert, what the plan
refuses, damaged checkpoints, router jitter, and the split q / k norms' rounding."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_hf_loading import _corrupt_checkpoints_job, _tiny

import tpcore.hf
from checks import expect_error
from hf_families import FAMILIES, load_dense, prompt, save_family
from tpcore.hf.tensor_parallel.plan import Load, make_plan
from tpcore.hf.tensor_parallel.weights import SafetensorsSource


def _experts_source(path: str) -> SafetensorsSource:
    policy = tpcore.hf.get_policy(transformers.AutoConfig.from_pretrained(path))
    return SafetensorsSource(path, "model", policy.checkpoint_renames, policy.expert_parts)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_fused_experts_read_from_per_expert_tensors(tmp_path, name):
    """transformers saves `experts.gate_up_proj` `[E, 2I, H]` as each expert's gate and up
    weights (Mixtral's w1 / w3); any ranges of the fused tensor read as transformers' own
    loading fuses them: the halves, a range across the gate | up boundary, ranges out of
    order, the columns of `down_proj`; from one file and from shards."""
    path = save_family(name, tmp_path / "single")
    sharded = tmp_path / "sharded"
    dense = load_dense(path, FAMILIES[name][0], torch.float32)
    dense.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    params = dict(dense.named_parameters())
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"
    inter = params[gate_up].shape[1] // 2
    loads = [
        Load(gate_up),
        Load(gate_up, 1, ((0, 8), (inter, inter + 8))),
        Load(gate_up, 1, ((inter - 5, inter + 3),)),
        Load(gate_up, 1, ((inter + 2, inter + 6), (1, 4))),
        Load("model.layers.0.mlp.experts.down_proj", 2, ((4, 12), (0, 2))),
    ]
    for source in map(_experts_source, (path, str(sharded))):
        assert gate_up in source and source.resolve(gate_up) is None
        for load in loads:
            full = params[load.key].detach()
            want = (
                full
                if load.dim is None
                else torch.cat(
                    [full.narrow(load.dim, lo, hi - lo) for lo, hi in load.ranges], load.dim
                )
            )
            assert torch.equal(source.read(load), want), f"{name} {load}"
        assert source.stored_shape(gate_up)[0] == list(params[gate_up].shape)


def test_unsplittable_experts_fail_in_the_plan():
    expect_error(
        ValueError,
        "mlp.experts intermediate features (90) is not divisible by tensor_parallel_size 4",
        make_plan,
        _tiny("mixtral", intermediate_size=90),
        4,
        1,
    )
    # 96 / 4 = 24 features: 96 bytes per row in float32, 48 in bfloat16; at 48 / 4 = 12, 24 bytes.
    make_plan(_tiny("mixtral").to(torch.bfloat16), 4, 0)
    expect_error(
        ValueError,
        (
            "12 intermediate features per rank (48 / tensor_parallel_size 4) "
            "in torch.bfloat16 make rows of 24 bytes"
        ),
        make_plan,
        _tiny("mixtral", intermediate_size=48).to(torch.bfloat16),
        4,
        0,
    )
    make_plan(_tiny("mixtral", intermediate_size=48), 4, 0)
    make_plan(
        _tiny("mixtral", intermediate_size=48, _experts_implementation="eager").to(torch.bfloat16),
        4,
        0,
    )  # no grouped GEMM


def test_modules_a_policy_does_not_account_for_are_refused():
    """A shared expert the policy does not cut would have its output summed over TP by the
    block's g; experts with biases (gpt-oss) are not the layout the plan cuts."""
    small = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
    )
    qwen2_moe = tpcore.hf.unregister_policy("qwen2_moe")
    moe = tpcore.hf.get_policy(transformers.MixtralConfig())
    try:
        for model_type, config, message in [
            (
                "qwen2_moe",
                transformers.Qwen2MoeConfig(
                    **small, moe_intermediate_size=32, shared_expert_intermediate_size=32
                ),
                "holds ['experts', 'gate', 'shared_expert', 'shared_expert_gate']; "
                "the policy accounts for 'experts', a router 'gate' "
                "and its moe_shared / moe_summed modules, "
                "not ['model.layers.0.mlp.shared_expert.down_proj', ",
            ),
            (
                "gpt_oss",
                transformers.GptOssConfig(**small, num_local_experts=4, head_dim=8),
                (
                    "expected gate_up_proj [experts, 2 x inter, hidden] "
                    "(gate half first) and down_proj"
                ),
            ),
        ]:  # Mixtral's policy (experts and a router, nothing else) under other model types
            tpcore.hf.register_policy(
                dataclasses.replace(
                    moe,
                    name=model_type,
                    model_types=(model_type,),
                    expert_parts={},
                    checkpoint_renames=(),
                )
            )
            try:
                with torch.device("meta"):
                    model = transformers.AutoModelForCausalLM.from_config(config)
                expect_error(ValueError, message, make_plan, model, 2, 0)
            finally:
                tpcore.hf.unregister_policy(model_type)
    finally:
        tpcore.hf.register_policy(qwen2_moe)


def _damaged(tmp_path) -> list[tuple[str, type, list[str]]]:
    path = save_family("qwen3_moe", tmp_path / "good")
    tensors = load_file(f"{path}/model.safetensors")
    cases = []
    missing = tmp_path / "missing"  # one expert's up projection left out
    missing.mkdir()
    (missing / "config.json").write_text(open(f"{path}/config.json").read())
    save_file(
        {k: v for k, v in tensors.items() if k != "model.layers.0.mlp.experts.2.up_proj.weight"},
        str(missing / "model.safetensors"),
        metadata={"format": "pt"},
    )
    cases.append(
        (
            str(missing),
            KeyError,
            ["model.layers.0.mlp.experts.2.gate_proj.weight", "but not all of", "expert 2"],
        )
    )
    # A whole expert's down projection left out, later experts there: the error blamed
    # config.json (expert 1) or named the fused tensor as missing (expert 0), not the tensor
    # the download lacks.
    for expert in (0, 1):
        gap = tmp_path / f"gap{expert}"
        gap.mkdir()
        (gap / "config.json").write_text(open(f"{path}/config.json").read())
        lost = f"model.layers.0.mlp.experts.{expert}.down_proj.weight"
        save_file(
            {k: v for k, v in tensors.items() if k != lost},
            str(gap / "model.safetensors"),
            metadata={"format": "pt"},
        )
        cases.append(
            (
                str(gap),
                KeyError,
                [f"{gap} lacks 1 tensor(s) of experts stored one by one: ['{lost}']"],
            )
        )
    contradicts = tmp_path / "contradicts"  # config.json says 8 experts, the weights hold 4
    contradicts.mkdir()
    config = json.load(open(f"{path}/config.json"))
    (contradicts / "config.json").write_text(json.dumps({**config, "num_local_experts": 8}))
    (contradicts / "model.safetensors").write_bytes(open(f"{path}/model.safetensors", "rb").read())
    cases.append(
        (
            str(contradicts),
            ValueError,
            [
                "contradicts the weights",
                "'model.layers.0.mlp.experts.gate_up_proj' is [4, 128, 64]",
                "the config gives [8, 128, 64]",
            ],
        )
    )
    return cases


def test_damaged_expert_checkpoints_fail_alike_on_every_rank(cpu_ranks, tmp_path):
    messages = cpu_ranks.run(
        _corrupt_checkpoints_job, _damaged(tmp_path)
    )  # each rank raised each error before any collective
    assert all(m == messages[0] for m in messages), "every rank must raise the same error"


def _jitter_job(rank, world, path):
    import tpcore

    tpcore.initialize_model_parallel(tensor_parallel_size=2)
    dense = load_dense(path, "MixtralForCausalLM", torch.float32)
    dense.config.router_jitter_noise = 0.1
    for layer in dense.model.layers:
        layer.mlp.jitter_noise = 0.1
    model = tpcore.hf.parallelize(load_dense(path, "MixtralForCausalLM", torch.float32))
    for layer in model.model.layers:
        layer.mlp.jitter_noise = 0.1
    ids = prompt()
    with torch.no_grad():  # jitter is drawn in training only: evaluation is exact
        torch.testing.assert_close(model(ids).logits, dense(ids).logits, rtol=1e-5, atol=1e-5)
    expect_error(
        RuntimeError,
        (
            "trains with router jitter noise (0.1), "
            "which each tensor-parallel rank would draw differently"
        ),
        model.train(),
        ids,
    )
    tpcore.destroy_model_parallel()
    return True


def test_router_jitter_in_training_is_refused_on_every_rank(cpu_ranks, tmp_path):
    assert all(cpu_ranks.run(_jitter_job, save_family("mixtral", tmp_path)))


def _forward_collectives(model, ids) -> int:
    import tpcore

    shm = tpcore.shm.shm_backend_of(tpcore.parallel_state.get_tensor_model_parallel_group())
    before = shm.fast_ops + shm.fallback_ops
    with torch.no_grad():
        model(ids)
    return shm.fast_ops + shm.fallback_ops - before


def _block_job(rank, world, paths):
    import tpcore

    tpcore.initialize_model_parallel(tensor_parallel_size=4)
    ids = prompt()
    counts = {
        name: _forward_collectives(
            tpcore.hf.from_pretrained(paths[name], model_class=FAMILIES[name][0]), ids
        )
        for name in ("llama", "mixtral", "qwen2_moe")
    }
    # A sparse MoE block takes the one all-reduce of the dense MLP it replaces, however many
    # experts, and a shared expert adds none: its linears stay nn.Linear, cut.
    assert counts["mixtral"] == counts["qwen2_moe"] == counts["llama"], counts
    shared = (
        tpcore.hf.from_pretrained(paths["qwen2_moe"], model_class="Qwen2MoeForCausalLM")
        .model.layers[0]
        .mlp.shared_expert
    )
    # (kept: an nn.Linear, no tpcore layer; its class a same-named subclass that keeps the
    # shard specs on deepcopy)
    down = shared.down_proj
    assert (
        type(down).__mro__[1:3] == (tpcore._module_utils.SharesProcessGroups, torch.nn.Linear)
        and type(down).__name__ == "Linear"
    )
    assert down.weight.shape == (64, 96 // 4) and down.weight.shard_spec.dim == 1
    # Cast after the split: 96 / 4 = 24 features make 48-byte rows in bfloat16, 12 make 24.
    model = tpcore.hf.parallelize(load_dense(paths["mixtral"], "MixtralForCausalLM", torch.float32))
    model.to(torch.bfloat16)(ids)
    narrow = load_dense(paths["narrow"], "MixtralForCausalLM", torch.float32)
    model = tpcore.hf.parallelize(narrow).to(torch.bfloat16)
    expect_error(
        RuntimeError,
        (
            "12 intermediate features per rank (48 / tensor_parallel_size 4) "
            "in torch.bfloat16 make rows of 24 bytes"
        ),
        model,
        ids,
    )
    tpcore.destroy_model_parallel()
    return True


def test_moe_blocks_take_one_all_reduce_and_check_their_dtype(cpu_ranks, tmp_path):
    paths = {name: save_family(name, tmp_path / name) for name in ("llama", "mixtral", "qwen2_moe")}
    narrow = transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            **{**FAMILIES["mixtral"][1]().to_dict(), "intermediate_size": 48}
        )
    )
    narrow.save_pretrained(tmp_path / "narrow")
    assert all(cpu_ranks.run(_block_job, {**paths, "narrow": str(tmp_path / "narrow")}))


def _checkpoint_layouts_job(rank, world, folders):
    import tpcore

    ids = prompt()
    dense = load_dense(folders[0], "Qwen3MoeForCausalLM", torch.float32)
    with torch.no_grad():
        want = dense(ids).logits
    for tp in (2, 4):
        tpcore.initialize_model_parallel(tensor_parallel_size=tp)
        for folder in folders:
            with torch.no_grad():
                got = tpcore.hf.from_pretrained(folder, model_class="Qwen3MoeForCausalLM")(
                    ids
                ).logits
            torch.testing.assert_close(
                got,
                want,
                rtol=1e-5,
                atol=1e-5 * want.abs().max().item(),
                msg=lambda m: f"{folder} TP={tp}: {m}",
            )
        tpcore.destroy_model_parallel()
    return True


def test_checkpoints_sharded_or_with_fused_experts_load(cpu_ranks, tmp_path):
    """from_pretrained reads experts stored expert by expert across shards, and experts a
    checkpoint stores fused as the model holds them (`experts.gate_up_proj`)."""
    path = save_family("qwen3_moe", tmp_path / "single")
    dense = load_dense(path, "Qwen3MoeForCausalLM", torch.float32)
    dense.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text(open(f"{path}/config.json").read())
    state = {
        k: v.contiguous()
        for k, v in dense.state_dict().items()
        if k != "lm_head.weight" or not dense.config.tie_word_embeddings
    }
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    assert any(
        k.endswith("experts.gate_up_proj") for k in load_file(str(fused / "model.safetensors"))
    )
    assert all(
        cpu_ranks.run(_checkpoint_layouts_job, [path, str(tmp_path / "sharded"), str(fused)])
    )


def _split_norm_job(rank, world):
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

    import tpcore
    from tpcore.models.split_norm import SplitRMSNorm
    from tpcore.parallel_state import get_tensor_model_parallel_rank

    tpcore.initialize_model_parallel(tensor_parallel_size=2)
    torch.manual_seed(0)
    half = slice(
        get_tensor_model_parallel_rank() * 128, (get_tensor_model_parallel_rank() + 1) * 128
    )
    for cls, after in ((Olmo2RMSNorm, False), (OlmoeRMSNorm, True)):
        dense = cls(256, eps=1e-5).to(torch.bfloat16)
        with torch.no_grad():
            dense.weight.uniform_(0.5, 1.5)
        x = torch.randn(64, 256).to(torch.bfloat16)
        split = SplitRMSNorm(128, 1e-5, weight_after_cast=after, dtype=torch.bfloat16)
        with torch.no_grad():
            split.weight.copy_(dense.weight[half])
            got, want = split(x[:, half]), dense(x)[:, half]
        # The mean of squares is summed in another order (float32), so a rare element may round
        # to the neighbouring bfloat16; the wrong order of weight and cast misses about 1 in 4.
        same = (got == want).float().mean().item()
        assert same >= 0.99, f"{cls.__name__}: {same:.3f} of the elements equal the dense norm's"
        torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
    tpcore.destroy_model_parallel()
    return True


def test_split_norms_round_like_transformers_norms(cpu_ranks):
    """OLMo 2 multiplies by the norm's weight before casting back to bfloat16, OLMoE after."""
    assert all(cpu_ranks.run(_split_norm_job))
