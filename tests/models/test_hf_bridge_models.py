"""Hugging Face models into GPTModel and back, against transformers computed in this test.

Tiny random Llama (GQA, llama3 rope scaling, attention biases), Qwen2 (q/k/v biases, tied
head), Mistral (GQA, a sliding window: longer sequences are refused), Qwen3 (q / k norms), Gemma
((1 + weight) norms, GeGLU, scaled embeddings, one KV head, tied head) and GPT-2 (erf
GeLU, untied head) are saved with `save_pretrained`, loaded sliced into GPTModel at
TP 1, 2, 4 and at TP 2 x PP 2 and TP 1 x PP 2 x 2 virtual chunks on 4 spawned ranks:
logits and loss equal transformers' in fp32, greedy generations identical; exported back
(TP 2 x PP 2, sharded) the files hold bitwise the original tensors and transformers loads
them. Bad folders raise the same error on every rank before any collective.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tpcore.hf.gpt_bridge import config_from_hf  # noqa: E402

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

VOCAB, SEQ, BATCH, NEW_TOKENS = 97, 12, 2, 6
LAYOUTS = [
    (1, 1, 1),
    (2, 1, 1),
    (4, 1, 1),
    (2, 2, 1),
    (1, 2, 2),
]  # (TP, PP, virtual chunks per rank) on 4 ranks


def _hf_model(family: str):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=96,
        max_position_embeddings=64,
    )
    if family == "llama":
        scaling = {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
        config = transformers.LlamaConfig(
            **common, rope_theta=5e5, rope_scaling=scaling, attention_bias=True
        )
    elif family == "qwen2":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True)
    elif family == "qwen3":
        config = transformers.Qwen3Config(
            **common, head_dim=16, tie_word_embeddings=True
        )  # q / k norms, wider heads
    elif family == "mistral":
        config = transformers.MistralConfig(
            **common, sliding_window=32, head_dim=16
        )  # Mistral-Nemo's heads: 8 x 16 in a 64-wide model
    elif family == "gemma":
        # one KV head (Gemma 2B's), heads of 16 (not hidden / heads), tied head; sqrt(48) is no
        # float
        config = transformers.GemmaConfig(
            **{**common, "num_key_value_heads": 1, "hidden_size": 48}, head_dim=16, pad_token_id=0
        )
    else:
        config = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=4,
            n_head=8,
            n_positions=64,
            activation_function="gelu",
            tie_word_embeddings=False,
        )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager"
    ).eval()
    with (
        torch.no_grad()
    ):  # nothing left at its init's constants (zero biases, unit norms): every slice shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral", "qwen3", "gemma", "gpt2"])
def family_case(request, tmp_path_factory):
    """(family, folder, ids, transformers' logits, loss and greedy tokens)."""
    family = request.param
    model = _hf_model(family)
    folder = tmp_path_factory.mktemp(family)
    model.save_pretrained(folder)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
        greedy = model.generate(
            ids[:, :4],
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return family, str(folder), ids, out.logits, out.loss, greedy


def _run_stages(chunks, ids, tp_group, pp_group):
    """Logits `[b, s, vocab_padded]` of the pipeline (every virtual stage in order, the
    activations sent point to point, TP shards gathered) on the last stage's ranks; None
    on the others."""
    import torch.distributed as dist

    from tpcore import comm
    from tpcore.pipeline_parallel import p2p

    pp, rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
    stages, x = pp * len(chunks), None
    shape = [ids.shape[1], ids.shape[0], chunks[0].config.hidden_size]
    for stage in range(stages):
        owner, chunk = stage % pp, chunks[stage // pp]
        if rank != owner:
            continue
        if stage > 0 and pp > 1:
            x = p2p.batch_send_recv(
                [],
                [(shape, (stage - 1) % pp, stage, "activation")],
                dtype=torch.float32,
                group=pp_group,
            )[0]
        x = chunk(ids if stage == 0 else x)
        if stage < stages - 1 and pp > 1:
            p2p.batch_send_recv(
                [(x.contiguous(), (stage + 1) % pp, stage + 1, "activation")],
                [],
                dtype=torch.float32,
                group=pp_group,
            )
    if rank != (stages - 1) % pp:
        return None
    return comm.all_gather(x.contiguous(), -1, tp_group)


def _load_job(rank, world, folder, ids, expected, loss, greedy, family):
    import torch.distributed as dist

    import tpcore
    from tpcore.hf.gpt_bridge import load_hf_weights
    from tpcore.models import generate
    from tpcore.pipeline_parallel import build_gpt_stages

    ok = []
    for tp, pp, v in LAYOUTS:
        tpcore.initialize_model_parallel(tensor_parallel_size=tp, pipeline_parallel_size=pp)
        state = tpcore.parallel_state.get_parallel_state()
        # make_vocab_size_divisible_by=2: the vocabulary of 97 is padded to a multiple of
        # 2 x TP, so every rank holds real rows and the last one padding too.
        config = config_from_hf(folder, make_vocab_size_divisible_by=2)
        chunks = build_gpt_stages(config, num_model_chunks=v, _init=False)
        load_hf_weights(chunks, folder)
        for chunk in chunks:
            chunk.eval()
        with torch.no_grad():
            logits = _run_stages(chunks, ids, state.tensor_group, state.pipeline_group)
        if logits is not None:  # the last stage's ranks
            torch.testing.assert_close(
                logits[..., :VOCAB],
                expected,
                rtol=1e-5,
                atol=1e-5,
                msg=lambda m: f"{family} TP {tp} PP {pp} x {v}: {m}",
            )
        if pp == 1:
            model = chunks[0]
            with torch.no_grad():
                # transformers' labels are shifted inside: position t predicts token t + 1.
                target = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100)], 1)
                torch.testing.assert_close(model(ids, target), loss, rtol=1e-5, atol=1e-6)
            tokens = generate(model, ids[:, :4], NEW_TOKENS, greedy=True)
            assert torch.equal(tokens, greedy), (
                f"{family} TP {tp}: greedy {tokens.tolist()} != transformers {greedy.tolist()}"
            )
            # Mistral: a sequence past the window is refused, not miscomputed
            if config.sliding_window is not None:
                long = torch.zeros(1, config.sliding_window + 1, dtype=torch.long)
                try:
                    model(long)
                except ValueError as e:
                    assert "sliding_window 32" in str(e), str(e)
                else:
                    raise AssertionError("a sequence longer than the sliding window was accepted")
        ok.append((tp, pp, v))
        tpcore.destroy_model_parallel()
    dist.barrier()
    return ok


def test_hf_into_gptmodel_matches_transformers(cpu_ranks, family_case):
    family, folder, ids, logits, loss, greedy = family_case
    results = cpu_ranks.run(_load_job, folder, ids, logits, loss, greedy, family, timeout=400)
    assert results == [LAYOUTS] * cpu_ranks.world


def _round_trip_job(rank, world, folder, out):
    import tpcore
    from tpcore.hf.gpt_bridge import export_hf, load_hf_weights
    from tpcore.pipeline_parallel import build_gpt_stages

    tpcore.initialize_model_parallel(tensor_parallel_size=2, pipeline_parallel_size=2)
    chunks = build_gpt_stages(config_from_hf(folder), _init=False)
    load_hf_weights(chunks, folder)
    with open(os.path.join(folder, "config.json")) as f:
        source = json.load(f)
    export_hf(chunks, out, hf_config=source, max_shard_size=200_000)  # several files and an index
    return sorted(os.listdir(out)) if rank == 0 else None


def test_round_trip_is_bitwise(cpu_ranks, family_case, tmp_path):
    """Loaded from the tensors as a base model saves them (no `model.` / `transformer.`
    prefix, which transformers finds either way), exported as the *ForCausalLM was."""
    family, folder, ids, logits, _, _ = family_case
    out, base = str(tmp_path / "export"), tmp_path / "base_model"
    base.mkdir()
    prefix = "transformer." if family == "gpt2" else "model."
    tensors = safetensors.load_file(os.path.join(folder, "model.safetensors"))
    assert any(k.startswith(prefix) for k in tensors), sorted(tensors)[:3]
    safetensors.save_file(
        {k.removeprefix(prefix): v for k, v in tensors.items()},
        str(base / "model.safetensors"),
        metadata={"format": "pt"},
    )
    shutil.copy(os.path.join(folder, "config.json"), base / "config.json")
    files = cpu_ranks.run(_round_trip_job, str(base), out, timeout=300)[0]
    assert (
        "model.safetensors.index.json" in files
        and "config.json" in files
        and "generation_config.json" in files
    )
    original = safetensors.load_file(os.path.join(folder, "model.safetensors"))
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    exported = {}
    for name in sorted(set(weight_map.values())):
        exported.update(safetensors.load_file(os.path.join(out, name)))
    assert exported.keys() == original.keys()
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    back = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager"
    ).eval()
    assert (
        type(back).__name__
        == json.load(open(os.path.join(folder, "config.json")))["architectures"][0]
    )
    with torch.no_grad():
        assert torch.equal(back(ids).logits, logits)


def _bad_folders(tmp_path, folder: str) -> list[tuple]:
    """(folder, error type, words its message holds[, folder whose config builds the model])."""

    def variant(name: str, **config_changes) -> str:
        path = str(tmp_path / name)
        shutil.copytree(folder, path)
        if config_changes:
            config = json.load(open(os.path.join(path, "config.json")))
            config.update(config_changes)
            json.dump(config, open(os.path.join(path, "config.json"), "w"))
        return path

    cases = []
    neox = variant("neox", model_type="gpt_neox")
    cases.append((neox, ValueError, ["'gpt_neox'", "not supported"]))
    yarn = variant("yarn", rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4})
    cases.append((yarn, ValueError, ["rope_type='yarn'"]))
    wider = variant("wider", intermediate_size=128)  # the weights are 96 wide
    # A model built from that config.json meets weights that contradict it; a model built
    # from the good one meets a folder that does not describe it.
    cases.append(
        (
            wider,
            ValueError,
            [
                f"{wider}/config.json contradicts the weights",
                "gate_proj.weight",
                "[96, 64]",
                "[128, 64]",
            ],
            wider,
        )
    )
    cases.append(
        (
            wider,
            ValueError,
            [
                f"{wider}/config.json does not describe this model",
                "ffn_hidden_size: folder 128, model 96",
            ],
        )
    )
    gemma = variant(
        "gemma",
        model_type="gemma",
        architectures=["GemmaForCausalLM"],
        hidden_act="gelu_pytorch_tanh",
    )
    # A Gemma folder differs from a Llama of the same shapes in its norm, activation and
    # embedding scale.
    cases.append(
        (
            gemma,
            ValueError,
            [
                f"{gemma}/config.json does not describe this model",
                "norm: folder 'gemma_rmsnorm', model 'rmsnorm'",
                "embedding_scale: folder 8.0, model None",
            ],
        )
    )
    sharded = variant("sharded")  # the model split over two files, the second one lost
    state = safetensors.load_file(os.path.join(sharded, "model.safetensors"))
    os.remove(os.path.join(sharded, "model.safetensors"))
    keys = sorted(state)
    halves = {
        "model-00001-of-00002.safetensors": keys[: len(keys) // 2],
        "model-00002-of-00002.safetensors": keys[len(keys) // 2 :],
    }
    for name, part in halves.items():
        safetensors.save_file(
            {k: state[k] for k in part}, os.path.join(sharded, name), metadata={"format": "pt"}
        )
    json.dump(
        {"metadata": {}, "weight_map": {k: n for n, part in halves.items() for k in part}},
        open(os.path.join(sharded, "model.safetensors.index.json"), "w"),
    )
    os.remove(os.path.join(sharded, "model-00002-of-00002.safetensors"))
    cases.append(
        (sharded, FileNotFoundError, ["model-00002-of-00002.safetensors", "which is not in"])
    )
    cases.append(
        (str(tmp_path / "missing"), FileNotFoundError, ["model folder", "missing does not exist"])
    )
    return cases


def _bad_folder_job(rank, world, good_folder, cases):
    import torch.distributed as dist

    import tpcore
    from tpcore.hf.gpt_bridge import load_hf_weights
    from tpcore.pipeline_parallel import build_gpt_stages

    tpcore.initialize_model_parallel(tensor_parallel_size=2, pipeline_parallel_size=2)
    good = config_from_hf(good_folder)
    messages = []
    for path, error, words, *config_from in cases:
        try:
            chunks = build_gpt_stages(
                config_from_hf(config_from[0]) if config_from else good, _init=False
            )
            load_hf_weights(chunks, path)
        except error as e:
            assert all(w in str(e) for w in words), f"rank {rank}, {path}: expected {words} in: {e}"
            messages.append(str(e))
        else:
            raise AssertionError(f"rank {rank}: {path} loaded")
    total = torch.ones(1)
    dist.all_reduce(total)  # every rank raised before any collective: still in step
    assert total.item() == world
    return messages


def test_bad_folders_fail_alike_on_every_rank(cpu_ranks, tmp_path):
    model = _hf_model("llama")
    model.save_pretrained(tmp_path / "good")
    cases = _bad_folders(tmp_path, str(tmp_path / "good"))
    messages = cpu_ranks.run(_bad_folder_job, str(tmp_path / "good"), cases, timeout=300)
    assert all(m == messages[0] for m in messages) and len(messages[0]) == len(cases)
