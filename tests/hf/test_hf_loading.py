"""tpcore.hf policies, plans and sliced loading: each rank's shards are exactly the slices
of the dense weights (cut here by hand from the safetensors file read with the
`safetensors` package), sharded checkpoints load alike, and every unsplittable or
unsupported model fails with a clear error before any weight moves."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import tpcore.hf
from checks import expect_error
from hf_families import FAMILIES, VOCAB, load_dense, save_family
from tpcore.hf.tensor_parallel.plan import make_plan
from tpcore.hf.tensor_parallel.policy import match


def test_pattern_matching():
    assert match("layers.*.self_attn.q_proj", "model.layers.3.self_attn.q_proj")
    assert match("layers.*.self_attn.q_proj", "layers.0.self_attn.q_proj")
    assert not match("layers.*.self_attn.q_proj", "model.layers.3.self_attn.q_proj_extra")
    assert not match("layers.*.self_attn.q_proj", "model.xlayers.3.self_attn.q_proj")
    assert not match("layer.*.output.dense", "bert.encoder.layer.0.attention.output.dense")
    assert match("layer.*.attention.output.dense", "bert.encoder.layer.0.attention.output.dense")


@pytest.mark.parametrize(
    "name",
    [
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma",
        "gemma2",
        "gemma3_text",
        "granite",
        "olmo",
        "smollm3",
        "gpt_neox",
        "phi3",
        "olmo2",
        "olmo3",
        "cohere",
        "cohere2",
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
        "olmoe",
    ],
)
def test_policy_tables_agree_with_transformers_tp_plan(name):
    """Where transformers ships a `base_model_tp_plan`, each colwise / rowwise module of it is
    in the family's table with the same role, and each module it replicates with summed
    gradients is a head norm (a renamed module in a new release shows up here)."""
    config = FAMILIES[name][1]()
    plan = getattr(config, "base_model_tp_plan", None) or {}
    # older releases may ship none (4.46 has none)
    if int(transformers.__version__.split(".")[0]) >= 5:
        assert plan, f"{name}: transformers {transformers.__version__} ships no base_model_tp_plan"
    policy = tpcore.hf.get_policy(config)
    for pattern, style in plan.items():
        if style == "moe_tp_experts":
            assert pattern in policy.moe_experts, (
                f"{name}: {pattern} ({style}) is not an experts module of {policy.name}"
            )
        # an experts parameter: cut with its module
        if pattern.rpartition(".")[0] in policy.moe_experts:
            continue
        if style.removeprefix("local_").split("_")[0] in (
            "colwise",
            "rowwise",
        ):  # colwise_gather_output, ...
            table = policy.column if "colwise" in style else policy.row
            assert pattern in table, (
                f"{name}: {pattern} ({style}) is not in the {policy.name} table"
            )
        if style == "replicated_with_grad_allreduce":
            assert pattern in policy.head_norms, (
                f"{name}: {pattern} ({style}) is not a head norm of {policy.name}"
            )


def test_unsupported_architecture_names_it_and_the_supported_ones():
    config = transformers.OPTConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=4
    )
    model = transformers.OPTForCausalLM(config)
    for call in (lambda: tpcore.hf.parallelize(model), lambda: make_plan(model, 2, 0)):
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert "'opt'" in message
        assert all(
            t in message
            for t in ("gpt2", "llama", "mistral", "qwen2", "gpt_neox", "bert", "roberta")
        )
    assert not any(isinstance(m, tpcore.VocabParallelEmbedding) for m in model.modules())


def test_embedding_with_an_unknown_forward_is_refused():
    """An nn.Embedding subclass with its own forward would lose it in the replacement; transformers'
    scaled word embeddings (Gemma's) are the one kind carried over (their scale)."""
    model = transformers.LlamaForCausalLM(FAMILIES["llama"][1]())

    class Shifted(torch.nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) + 1

    old = model.model.embed_tokens
    model.model.embed_tokens = Shifted(old.num_embeddings, old.embedding_dim)
    with pytest.raises(
        ValueError, match="'model.embed_tokens' is a Shifted, an nn.Embedding with its own forward"
    ):
        make_plan(model, 2, 0)
    gemma = transformers.GemmaForCausalLM(FAMILIES["gemma"][1]())
    scale = gemma.model.embed_tokens.scalar_embed_scale
    assert scale == 64**0.5 and make_plan(gemma, 2, 0).replacements[0].embed_scale == scale


def _tiny(name: str, **overrides):
    cls, make_config = FAMILIES[name]
    config = make_config()
    for key, value in overrides.items():
        setattr(config, key, value)
    with torch.device("meta"):
        return getattr(transformers, cls)(config)


@pytest.mark.parametrize(
    "name, overrides, tp, message",
    [
        (
            "gpt2",
            dict(n_head=8, n_embd=48),
            16,
            "8 attention heads cannot be split over tensor_parallel_size 16",
        ),
        (
            "llama",
            dict(num_attention_heads=6, num_key_value_heads=3),
            2,
            "3 key/value heads and tensor_parallel_size 2",
        ),
        (
            "llama",
            dict(intermediate_size=98),
            4,
            "mlp.gate_proj output features (98) is not divisible by tensor_parallel_size 4",
        ),
        (
            "bert",
            dict(intermediate_size=90),
            4,
            "intermediate.dense output features (90) is not divisible",
        ),
    ],
)
def test_unsplittable_sizes_fail_in_the_plan(name, overrides, tp, message):
    """make_plan reads only shapes (the model is on the meta device here) and is what
    parallelize / from_pretrained run before any weight moves."""
    model = _tiny(name, **overrides)
    for rank in range(tp):
        expect_error(ValueError, message, make_plan, model, tp, rank)


def test_register_policy():
    with pytest.raises(ValueError, match="already have a policy"):
        tpcore.hf.register_policy(tpcore.hf.get_policy(transformers.LlamaConfig()))
    with pytest.raises(ValueError, match="unknown kind"):
        tpcore.hf.Policy(name="x", model_types=("x",), column={"a": "rows"}, row=(), embedding=())
    custom = tpcore.hf.Policy(
        name="opt",
        model_types=("opt",),
        column={"layers.*.self_attn.q_proj": "heads"},
        row=("layers.*.self_attn.out_proj",),
        embedding=("embed_tokens",),
    )
    tpcore.hf.register_policy(custom)
    try:
        assert (
            tpcore.hf.get_policy(transformers.OPTConfig()) is custom
            and "opt" in tpcore.hf.supported_model_types()
        )
    finally:
        tpcore.hf.unregister_policy("opt")


def _expected_shards(
    name: str, dense: dict[str, torch.Tensor], tp: int, rank: int
) -> dict[str, torch.Tensor]:
    """This rank's slices of the dense tensors, cut by hand for the llama / gpt2 layouts."""
    rows = -(-VOCAB // tp)

    def vocab(t):
        out = t.new_zeros(rows, *t.shape[1:])
        part = t[rank * rows : (rank + 1) * rows]
        out[: part.shape[0]] = part
        return out

    expected = {}
    for key, t in dense.items():
        if name == "gpt2":
            if key.endswith(
                "attn.c_attn.weight"
            ):  # [in, 3 * out]: q | k | v, each cut, then transposed
                expected[key] = torch.cat([b.chunk(tp, 1)[rank] for b in t.chunk(3, 1)], 1).t()
            elif key.endswith("attn.c_attn.bias"):
                expected[key] = torch.cat([b.chunk(tp, 0)[rank] for b in t.chunk(3, 0)])
            elif key.endswith(("mlp.c_fc.weight", "attn.c_proj.weight", "mlp.c_proj.weight")):
                expected[key] = t.chunk(tp, 1 if "c_fc" in key else 0)[rank].t()
            elif key.endswith("mlp.c_fc.bias"):
                expected[key] = t.chunk(tp, 0)[rank]
            elif key.endswith("wte.weight"):
                expected[key] = vocab(t)
            else:
                expected[key] = t
        else:  # llama: 8 query heads, 2 KV heads of 8 features (hidden 64)
            if key.endswith(("k_proj.weight", "v_proj.weight")):
                heads = t.view(2, 8, -1)
                expected[key] = (
                    heads.chunk(tp, 0)[rank].reshape(-1, t.shape[1])
                    if tp <= 2
                    else heads[rank * 2 // tp]
                )
            elif key.endswith(("q_proj.weight", "gate_proj.weight", "up_proj.weight")):
                expected[key] = t.chunk(tp, 0)[rank]
            elif key.endswith(("o_proj.weight", "down_proj.weight")):
                expected[key] = t.chunk(tp, 1)[rank]
            elif key.endswith(("embed_tokens.weight", "lm_head.weight")):
                expected[key] = vocab(t)
            else:
                expected[key] = t
    return expected


def _shards_job(rank, world, name, path, sharded_path, base_path):
    import tpcore

    dense = load_file(f"{path}/model.safetensors")
    for tp in (2, 4):
        tpcore.initialize_model_parallel(tensor_parallel_size=tp)
        tp_rank = torch.distributed.get_rank(
            tpcore.parallel_state.get_tensor_model_parallel_group()
        )
        expected = _expected_shards(name, dense, tp, tp_rank)
        for source in (path, sharded_path, base_path):
            model = tpcore.hf.from_pretrained(source)
            state = model.state_dict()
            assert expected.keys() <= state.keys()
            for key, want in expected.items():
                assert state[key].shape == want.shape and torch.equal(state[key], want), (
                    f"{name} TP={tp} rank {tp_rank} {source}: {key} is not its slice"
                )
        tpcore.destroy_model_parallel()
    return True


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_shards_are_the_dense_slices(cpu_ranks, tmp_path, name):
    """TP 2 and 4 (llama: KV heads replicated at 4), single-file and sharded checkpoints."""
    path = save_family(name, tmp_path / "single")
    sharded = tmp_path / "sharded"
    getattr(transformers, FAMILIES[name][0]).from_pretrained(path).save_pretrained(
        sharded, max_shard_size="40KB"
    )
    assert (sharded / "model.safetensors.index.json").exists()
    # The tensors as the base model saves them: no `model.` / `transformer.` prefix.
    base = tmp_path / "base_model"
    base.mkdir()
    prefix = "transformer." if name == "gpt2" else "model."
    tensors = load_file(f"{path}/model.safetensors")
    assert any(k.startswith(prefix) for k in tensors)
    save_file(
        {k.removeprefix(prefix): v for k, v in tensors.items()},
        str(base / "model.safetensors"),
        metadata={"format": "pt"},
    )
    shutil.copy(f"{path}/config.json", base / "config.json")
    assert all(cpu_ranks.run(_shards_job, name, path, str(sharded), str(base)))


def _errors_job(rank, world, path):
    import tpcore

    tpcore.initialize_model_parallel(tensor_parallel_size=4)
    expect_error(
        ValueError,
        "tensor_parallel_size=2 but the tensor-parallel group has 4 ranks",
        tpcore.hf.from_pretrained,
        path,
        tensor_parallel_size=2,
    )
    dense = load_dense(path, "GPT2LMHeadModel", torch.float32)
    model = tpcore.hf.parallelize(copy.deepcopy(dense))
    expect_error(ValueError, "already holds tpcore layers", tpcore.hf.parallelize, model)
    expect_error(
        ValueError,
        "has no vocab-parallel LM head",
        tpcore.hf.generate,
        dense,
        torch.zeros(1, 2, dtype=torch.long),
    )
    expect_error(
        ValueError,
        f"token id {VOCAB} is outside",
        tpcore.hf.generate,
        model,
        torch.full((1, 2), VOCAB),
    )
    expect_error(
        ValueError,
        "top_p must be in (0, 1]",
        tpcore.hf.generate,
        model,
        torch.zeros(1, 2, dtype=torch.long),
        top_p=0.0,
    )
    # GPT-2 with 4 heads at TP=4 works; a config with 6 heads fails before any weight moves.
    six = transformers.GPT2Config(vocab_size=VOCAB, n_embd=48, n_layer=1, n_head=6, n_positions=16)
    torch.manual_seed(0)
    unsplittable = transformers.GPT2LMHeadModel(six)
    before = {k: v.clone() for k, v in unsplittable.state_dict().items()}
    expect_error(
        ValueError,
        "6 attention heads cannot be split over tensor_parallel_size 4",
        tpcore.hf.parallelize,
        unsplittable,
    )
    after = unsplittable.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not any(isinstance(m, tpcore.ColumnParallelLinear) for m in unsplittable.modules())
    return True


def test_errors_before_any_collective(cpu_ranks, tmp_path):
    path = save_family("gpt2", tmp_path)
    assert all(cpu_ranks.run(_errors_job, path))


def test_missing_checkpoint_is_named(tmp_path):
    from tpcore.hf.tensor_parallel.weights import SafetensorsSource

    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        SafetensorsSource(str(tmp_path))


OPT_POLICY = dict(
    name="opt",
    model_types=("opt",),
    column={
        "layers.*.self_attn.q_proj": "heads",
        "layers.*.self_attn.k_proj": "heads",
        "layers.*.self_attn.v_proj": "heads",
        "layers.*.fc1": "plain",
    },
    row=("layers.*.self_attn.out_proj", "layers.*.fc2"),
    embedding=("embed_tokens",),
    head=("lm_head",),
    attention=("layers.*.self_attn",),
    attention_attributes={"num_heads": "heads", "embed_dim": "width"},
)


def _user_policy_job(rank, world, path):
    import tpcore

    tpcore.hf.register_policy(tpcore.hf.Policy(**OPT_POLICY))
    try:
        dense = load_dense(path, "OPTForCausalLM", torch.float32)
        ids = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = dense(ids).logits
        for tp in (2, 4):
            tpcore.initialize_model_parallel(tensor_parallel_size=tp)
            model = tpcore.hf.from_pretrained(path)
            assert isinstance(model.model.decoder.layers[0].fc1, tpcore.ColumnParallelLinear)
            with torch.no_grad():
                got = model(ids).logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
            assert torch.equal(
                tpcore.hf.generate(model, ids, max_new_tokens=8),
                dense.generate(ids, max_new_tokens=8, do_sample=False),
            )
            tpcore.destroy_model_parallel()
    finally:
        tpcore.hf.unregister_policy("opt")
    return True


def test_user_registered_policy_splits_a_new_family(cpu_ranks, tmp_path):
    """OPT has no built-in policy; a user's table of eight lines makes it work."""
    config = transformers.OPTConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        ffn_dim=128,
        num_attention_heads=4,
        max_position_embeddings=64,
        word_embed_proj_dim=64,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=1,
        init_std=0.2,
        dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    transformers.OPTForCausalLM(config).save_pretrained(tmp_path)
    assert all(cpu_ranks.run(_user_policy_job, str(tmp_path)))


def _corrupt_checkpoints(tmp_path) -> list[tuple[str, type, list[str]]]:
    """(path, error type, strings the message must hold) for each way a folder can be bad."""
    import json
    import os
    import shutil
    import struct

    good = save_family("gpt2", tmp_path / "good")
    cases = []

    def variant(name: str) -> str:
        path = tmp_path / name
        shutil.copytree(good, path)
        return str(path)

    def edit_config(path: str, **changes) -> None:
        config = json.loads(open(f"{path}/config.json").read())
        config.update(changes)
        open(f"{path}/config.json", "w").write(json.dumps(config))

    wider = variant("wider")  # config.json says 32 wide, the weights are 64 wide
    edit_config(wider, n_embd=32)
    cases.append(
        (
            wider,
            ValueError,
            [
                f"{wider}/config.json contradicts the weights",
                "'transformer.wte.weight'",
                "config gives [97, 32]",
                f"[97, 64] in {wider}/model.safetensors",
            ],
        )
    )
    vocab = variant("vocab")
    edit_config(vocab, vocab_size=VOCAB + 3)
    cases.append(
        (
            vocab,
            ValueError,
            ["'transformer.wte.weight'", f"config gives [{VOCAB + 3}, 64]", f"[{VOCAB}, 64] in"],
        )
    )
    raw = open(f"{good}/model.safetensors", "rb").read()
    length = variant(
        "length"
    )  # a header length far past the end of the file (it read 2**62 bytes: MemoryError)
    open(f"{length}/model.safetensors", "wb").write(struct.pack("<Q", 2**62) + raw[8:])
    cases.append(
        (
            length,
            ValueError,
            [f"{length}/model.safetensors", f"header length {2**62}", f"file has {len(raw)} bytes"],
        )
    )
    header = variant("header")  # the JSON header damaged (its first byte)
    open(f"{header}/model.safetensors", "wb").write(raw[:8] + b"x" + raw[9:])
    cases.append((header, ValueError, [f"{header}/model.safetensors", "header is not valid JSON"]))
    offsets = variant(
        "offsets"
    )  # a tensor's data range past the end of the file (a truncated download)
    open(f"{offsets}/model.safetensors", "wb").write(raw[: len(raw) - 100])
    cases.append(
        (offsets, ValueError, [f"{offsets}/model.safetensors", "ends at byte", "truncated"])
    )
    no_config = variant(
        "no-config"
    )  # transformers' "Unrecognized model ... Should have a `model_type` key in its config.json"
    os.remove(f"{no_config}/config.json")
    cases.append((no_config, FileNotFoundError, [f"{no_config} has no config.json"]))
    missing = str(tmp_path / "no-such-model")
    cases.append((missing, FileNotFoundError, [f"{missing} does not exist"]))
    # an index.json that sends a tensor to a shard without it (a bare KeyError:
    # 'transformer.wte.weight')
    index = variant("index")
    save_file({"other": torch.zeros(1)}, f"{index}/extra.safetensors")
    weight_map = {key: "model.safetensors" for key in load_file(f"{good}/model.safetensors")}
    open(f"{index}/model.safetensors.index.json", "w").write(
        json.dumps({"weight_map": {**weight_map, "transformer.wte.weight": "extra.safetensors"}})
    )
    cases.append(
        (
            index,
            ValueError,
            [
                f"{index}/model.safetensors.index.json maps 'transformer.wte.weight' "
                "to extra.safetensors, which does not hold it"
            ],
        )
    )
    return cases


def _corrupt_checkpoints_job(rank, world, cases):
    import torch.distributed as dist

    import tpcore

    tpcore.initialize_model_parallel(tensor_parallel_size=2)
    messages = []
    for path, error, parts in cases:
        try:
            tpcore.hf.from_pretrained(path)
        except error as e:
            assert all(part in str(e) for part in parts), (
                f"rank {rank}, {path}: expected {parts} in: {e}"
            )
            messages.append(str(e))
        else:
            raise AssertionError(f"rank {rank}: {path} loaded")
    # Every rank raised before any collective: the ranks are still in step.
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == world
    return messages


def test_bad_checkpoints_fail_alike_on_every_rank(cpu_ranks, tmp_path):
    """A config.json that contradicts the weights (it raised an expand error on one rank and a
    gloo error on the other), a corrupt safetensors header length (MemoryError) or header
    (the file unnamed), a truncated file and a missing folder ("Repo id must be in the form")
    each raise the same clear error on every rank, naming the file, before any collective; so
    does an index.json that names a shard without the tensor (a bare KeyError naming only the
    tensor) and a folder without config.json (transformers' "Unrecognized model")."""
    cases = _corrupt_checkpoints(tmp_path)
    messages = cpu_ranks.run(_corrupt_checkpoints_job, cases)
    assert all(m == messages[0] for m in messages), "every rank must raise the same error"


def _config_beside_weights_job(rank, world, cases, ids):
    import warnings

    import tpcore

    tpcore.initialize_model_parallel(tensor_parallel_size=2)
    messages = {}
    for path, expected in cases:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = tpcore.hf.from_pretrained(path)
        with torch.no_grad():
            torch.testing.assert_close(
                model(ids).logits,
                expected,
                rtol=1e-5,
                atol=1e-5,
                msg=lambda m: f"rank {rank}, {path}: {m}",
            )
        messages[path] = [str(w.message) for w in caught if str(w.message).startswith("tpcore.hf")]
    return messages


def test_config_that_disagrees_with_the_weights_loads_as_transformers_does(cpu_ranks, tmp_path):
    """Two config.json edits that transformers loads with a warning, not silently otherwise:
    `tie_word_embeddings: true` beside a checkpoint that stores its own, different
    `lm_head.weight` (transformers 5 keeps the saved head apart; 4.x ties it to the
    embedding), and fewer `num_hidden_layers` than the weights hold (the rest are unexpected
    keys). The split model gives transformers' logits and warns, naming the tensors."""
    import json
    import shutil

    source = save_family("llama", tmp_path / "llama")  # its own head (tie_word_embeddings=False)

    def variant(name: str, **changes) -> str:
        path = tmp_path / name
        path.mkdir()
        shutil.copyfile(f"{source}/model.safetensors", path / "model.safetensors")
        config = json.loads(open(f"{source}/config.json").read())
        (path / "config.json").write_text(json.dumps({**config, **changes}))
        return str(path)

    tied, short = variant("tied", tie_word_embeddings=True), variant("short", num_hidden_layers=1)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    cases, unexpected = [], {}
    for path in (tied, short):
        dense, info = transformers.LlamaForCausalLM.from_pretrained(path, output_loading_info=True)
        with torch.no_grad():
            cases.append((path, dense.eval()(ids).logits))
        unexpected[path] = sorted(info["unexpected_keys"])
    assert unexpected[tied] == [] and len(unexpected[short]) == 9  # layer 1's tensors
    for messages in cpu_ranks.run(_config_beside_weights_job, cases, ids):
        assert (
            len(messages[tied]) == 1
            and "lm_head.weight" in messages[tied][0]
            and "model.embed_tokens.weight" in messages[tied][0]
        ), messages
        assert len(messages[short]) == 1, messages
        assert (
            f"9 tensor(s) of {short} are unexpected" in messages[short][0]
            and str(unexpected[short][:8]) in messages[short][0]
        ), messages


def _save_pretrained_job(rank, world, path, out):
    import os

    import tpcore

    tpcore.initialize_model_parallel(tensor_parallel_size=2)
    dense = load_dense(path, "GPT2LMHeadModel", torch.float32)
    for model in (tpcore.hf.from_pretrained(path), tpcore.hf.parallelize(copy.deepcopy(dense))):
        for target in (model, model.transformer, copy.deepcopy(model)):
            expect_error(
                NotImplementedError,
                (
                    f"tpcore.hf: save_pretrained of a {type(target).__name__} "
                    "split by tpcore.hf would write one rank's slices"
                ),
                target.save_pretrained,
                out,
            )
    assert not os.path.exists(out)  # nothing written
    if rank == 0:  # the dense model is untouched: it still saves (what the message advises)
        dense.save_pretrained(out + "-dense")
    return True


def test_save_pretrained_of_a_split_model_is_refused(cpu_ranks, tmp_path):
    """It wrote rank 0's slices under the full model's names (exit 0) and transformers could
    not load the folder; now every rank raises, pointing to tpcore.hf.save_pretrained."""
    path = save_family("gpt2", tmp_path / "gpt2")
    out = str(tmp_path / "saved")
    assert all(cpu_ranks.run(_save_pretrained_job, path, out))
    reloaded = load_dense(out + "-dense", "GPT2LMHeadModel", torch.float32)
    original = load_dense(path, "GPT2LMHeadModel", torch.float32)
    assert all(
        torch.equal(a, b)
        for a, b in zip(reloaded.state_dict().values(), original.state_dict().values())
    )
