"""The Hugging Face bridge with fewer KV heads than TP ranks (GPTModel copies each KV head
on the ranks whose queries use it, as `tpcore.hf` does), against transformers computed here:
a Llama with 2 KV heads loaded at TP 4 (1 KV head at TP 2 x PP 2) gives transformers'
logits and loss; exported at TP 4 it round-trips bitwise and transformers loads it; trained
at TP 4 and checkpointed, it loads at TP 1 and TP 2 with the same weights and AdamW state
(the dense tensors gathered from the TP 4 run), and `tpcore-convert --to-hf` of that
checkpoint gives transformers the TP 4 model's logits.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tpcore.hf.gpt_bridge import config_from_hf  # noqa: E402

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

VOCAB, SEQ, BATCH = 97, 12, 2


def _hf_llama(kv_heads: int):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        intermediate_size=96,
        max_position_embeddings=64,
        attention_bias=True,
    )
    torch.manual_seed(kv_heads)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager"
    ).eval()
    with torch.no_grad():  # no zero biases or unit norms left: every slice shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{kv heads: (folder, ids, transformers' logits and loss)} for 2 and 1 KV heads."""
    out = {}
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    for kv in (2, 1):
        model, folder = _hf_llama(kv), tmp_path_factory.mktemp(f"llama_kv{kv}")
        model.save_pretrained(folder)
        with torch.no_grad():
            result = model(input_ids=ids, labels=ids)
        out[kv] = (str(folder), ids, result.logits, result.loss)
    return out


def _load_job(rank, world, folders, out):
    from test_hf_bridge_models import _run_stages

    import tpcore
    from tpcore.hf.gpt_bridge import export_hf, load_hf_weights
    from tpcore.pipeline_parallel import build_gpt_stages

    for kv, tp, pp in ((2, 4, 1), (1, 2, 2), (1, 4, 1)):
        folder, ids, expected, loss = folders[kv]
        tpcore.initialize_model_parallel(tensor_parallel_size=tp, pipeline_parallel_size=pp)
        state = tpcore.parallel_state.get_parallel_state()
        config = config_from_hf(folder, make_vocab_size_divisible_by=2)
        chunks = build_gpt_stages(config, _init=False)
        load_hf_weights(chunks, folder)
        qkv = dict(chunks[0].named_parameters())[
            f"layers.{min(chunks[0].layers._modules, key=int)}.attention.qkv.weight"
        ]
        assert qkv.shape[0] == (8 // tp + 2) * 8, (
            f"kv {kv} TP {tp}: one KV head per rank, got {list(qkv.shape)}"
        )
        with torch.no_grad():
            logits = _run_stages(
                [c.eval() for c in chunks], ids, state.tensor_group, state.pipeline_group
            )
            if logits is not None:
                torch.testing.assert_close(
                    logits[..., :VOCAB],
                    expected,
                    rtol=1e-5,
                    atol=1e-5,
                    msg=lambda m: f"kv {kv} TP {tp} PP {pp}: {m}",
                )
            if pp == 1:
                target = torch.cat(
                    [ids[:, 1:], torch.full((ids.shape[0], 1), -100)], 1
                )  # transformers shifts labels inside
                torch.testing.assert_close(chunks[0](ids, target), loss, rtol=1e-5, atol=1e-6)
        if (kv, tp) == (2, 4):
            with open(os.path.join(folder, "config.json")) as f:
                export_hf(chunks, out, hf_config=json.load(f))
        tpcore.destroy_model_parallel()


def test_hf_llama_with_fewer_kv_heads_than_tp(cpu_ranks, folders, tmp_path):
    out = str(tmp_path / "export")
    cpu_ranks.run(_load_job, folders, out, timeout=300)
    folder, ids, logits, _ = folders[2]
    original, exported = (
        safetensors.load_file(os.path.join(folder, "model.safetensors")),
        safetensors.load_file(os.path.join(out, "model.safetensors")),
    )
    assert exported.keys() == original.keys()
    for key, tensor in original.items():  # the K / V projections once, at their dense shape
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    back = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        assert torch.equal(back(ids).logits, logits)


def _train_and_save(rank, world, folder, save_dir, dense_file):
    """TP 4 from the HF folder, 3 AdamW steps with active clipping, checkpoint; the dense
    weights and AdamW moments (gathered, first copy of each KV head) into `dense_file`."""
    from checks import param_specs, setup_tp
    from tpcore.hf.gpt_bridge import load_hf_weights
    from tpcore.models import GPTModel
    from tpcore.tensor_parallel.shard_spec import unshard
    from tpcore.train import save_checkpoint
    from train_checks import CLIP, LRS, make_adamw, tp_dp_groups, train_batch

    setup_tp(4, replicas=True)
    tp_group, dp_group = tp_dp_groups()
    config = config_from_hf(folder, make_vocab_size_divisible_by=2)
    model = GPTModel(config, _init=False)
    load_hf_weights(model, folder)
    opt = make_adamw(model, config)
    for step, lr in enumerate(LRS):
        ids, target = train_batch(step, config)
        model(ids, target).backward()
        norm, skipped = opt.step(lr, CLIP)
        assert not skipped and norm > CLIP
    # The copies of a KV head took the same steps: still bitwise equal. Rows: 2 query heads,
    # then K and V (8 each).
    every = [torch.empty_like(model.layers[0].attention.qkv.weight) for _ in range(4)]
    torch.distributed.all_gather(
        every, model.layers[0].attention.qkv.weight.detach(), group=tp_group
    )
    kv = [w[16:] for w in every]
    assert (
        kv[0].shape[0] == 16
        and torch.equal(kv[0], kv[1])
        and torch.equal(kv[2], kv[3])
        and not torch.equal(kv[0], kv[2])
    )
    save_checkpoint(
        save_dir, len(LRS), model, opt, consumed_samples=6, tp_group=tp_group, dp_group=dp_group
    )
    dense = {name: unshard(p.detach(), p.shard_spec) for name, p in model.named_parameters()}
    for name, entry in opt.state_dict()["params"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            dense[f"{name}/{key}"] = unshard(entry[key], param_specs(model)[name])
    ids, _ = train_batch(99, config)
    with torch.no_grad():
        dense["logits"] = _gathered_logits(model, ids, tp_group)
    dense["ids"] = ids
    if rank == 0:
        torch.save(dense, dense_file)
    torch.distributed.barrier()


def _gathered_logits(model, ids, tp_group):
    from tpcore import comm

    return comm.all_gather(model.eval()(ids).contiguous(), -1, tp_group)[..., :VOCAB]


def _load_at(rank, world, save_dir, dense_file, tp):
    from checks import param_specs, setup_tp
    from tpcore.models import GPTConfig, GPTModel
    from tpcore.tensor_parallel.shard_spec import unshard
    from tpcore.train import load_checkpoint
    from train_checks import make_adamw, tp_dp_groups

    setup_tp(tp, replicas=True)
    tp_group, _ = tp_dp_groups()
    dense = torch.load(dense_file, weights_only=True)
    meta = json.load(open(os.path.join(save_dir, "iter_0000003", "metadata.json")))
    config = GPTConfig(**meta["model_config"])
    torch.manual_seed(5)
    model = GPTModel(config)  # other weights until loaded
    opt = make_adamw(model, config)
    load_checkpoint(save_dir, model, opt, tp_group=tp_group)
    for name, p in model.named_parameters():
        assert torch.equal(unshard(p.detach(), p.shard_spec), dense[name]), f"TP {tp}: {name}"
    for name, entry in opt.state_dict()["params"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            got = unshard(entry[key], param_specs(model)[name])
            assert torch.equal(got, dense[f"{name}/{key}"]), f"TP {tp}: optimizer {name}/{key}"
    with torch.no_grad():
        torch.testing.assert_close(
            _gathered_logits(model, dense["ids"], tp_group), dense["logits"], rtol=1e-5, atol=1e-5
        )


def test_checkpoint_at_tp4_loads_at_tp1_and_tp2_and_converts(cpu_ranks, folders, tmp_path):
    from tpcore.train.convert import main as convert

    save_dir, dense_file = str(tmp_path / "ckpt"), str(tmp_path / "dense.pt")
    cpu_ranks.run(_train_and_save, folders[2][0], save_dir, dense_file, timeout=300)
    for tp in (1, 2):
        cpu_ranks.run(_load_at, save_dir, dense_file, tp, timeout=300)
    out = str(tmp_path / "hf")
    assert convert(["--load", save_dir, "--to-hf", out]) == 0
    dense = torch.load(dense_file, weights_only=True)
    back = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager"
    ).eval()
    k = safetensors.load_file(os.path.join(out, "model.safetensors"))[
        "model.layers.0.self_attn.k_proj.weight"
    ]
    assert k.shape == (2 * 8, 64) and torch.equal(k, dense["layers.0.attention.qkv.weight"][64:80])
    with torch.no_grad():
        torch.testing.assert_close(back(dense["ids"]).logits, dense["logits"], rtol=1e-5, atol=1e-5)
