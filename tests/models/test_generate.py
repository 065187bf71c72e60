"""Text generation: the TP model produces the dense model's tokens on every rank."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from checks import GPT_VARIANTS as VARIANTS
from checks import GQA_VARIANTS, assert_close, expect_error, setup_tp
from tpcore.models import GPTModel, ReferenceGPT, generate
from tpcore.models.kv_cache import KVCache

NEW = 4


def _models(variant, sequence_parallel=False):
    config = dataclasses.replace(VARIANTS[variant], sequence_parallel=sequence_parallel)
    torch.manual_seed(0)
    dense = ReferenceGPT(config)
    torch.manual_seed(0)
    return dense, GPTModel(config)


def _prompt(batch, length, seed=3):
    return torch.randint(0, 50, (batch, length), generator=torch.Generator().manual_seed(seed))


def _same_on_all_ranks(t: torch.Tensor, what: str) -> None:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    for r, g in enumerate(gathered):
        assert torch.equal(g, t), f"{what}: rank {r} generated {g.tolist()}, this rank {t.tolist()}"


def _manual_greedy(dense: ReferenceGPT, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """An independent greedy loop: argmax over the last max_position_embeddings tokens."""
    tokens = prompt
    with torch.no_grad():
        for _ in range(n):
            logits = dense(tokens[:, -dense.config.max_position_embeddings :])[:, -1]
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], 1)
    return tokens


def _matches_dense(rank, world, tp, variant, sequence_parallel):
    setup_tp(tp, replicas=True)
    dense, model = _models(variant, sequence_parallel)
    # Length 3 grows through windows not divisible by TP (SP pads); 14 crosses 16 and is cropped.
    for length in (3, 14):
        prompt = _prompt(2, length)
        cases = {
            "greedy": dict(greedy=True),
            "top-k": dict(top_k=5, temperature=0.8, seed=7),
            "full softmax": dict(seed=11),
        }
        outs = {}
        for name, kw in cases.items():
            what = f"{name}, prompt length {length}"
            ref = generate(dense, prompt, NEW, **kw)
            out = generate(model, prompt, NEW, **kw)
            assert out.shape == (2, length + NEW) and out.dtype == torch.int64, what
            assert torch.equal(out[:, :length], prompt), what
            assert torch.equal(out, ref), f"{what}: TP {out.tolist()} vs dense {ref.tolist()}"
            _same_on_all_ranks(out, what)
            outs[name] = out
        assert torch.equal(outs["greedy"], _manual_greedy(dense, prompt, NEW)), (
            f"greedy vs manual loop, length {length}"
        )
        top1 = generate(model, prompt, NEW, top_k=1, seed=5)
        assert torch.equal(top1, outs["greedy"]), "top_k=1 sampling must equal greedy"


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_generate_matches_dense(cpu_ranks, tp, variant, sequence_parallel):
    cpu_ranks.run(_matches_dense, tp, variant, sequence_parallel)


def _expected_with_eod(full: torch.Tensor, length: int, eod: int) -> torch.Tensor:
    """What eod stopping should make of an un-stopped greedy run (rows are independent)."""
    out, ends = full.clone(), []
    for row in out:
        hits = (row[length:] == eod).nonzero()
        end = length + int(hits[0]) + 1 if len(hits) else row.numel()
        row[end:] = eod
        ends.append(end)
    return out[:, : max(ends)]


def _eod(rank, world):
    setup_tp(2, replicas=True)
    dense, model = _models("gpt2")
    prompt = _prompt(2, 4, seed=4)
    full = generate(model, prompt, 6, greedy=True)
    for eod in (int(full[0, 5]), int(full[1, 4]), int(full[0, 4])):
        out = generate(model, prompt, 6, greedy=True, eod=eod)
        assert torch.equal(out, _expected_with_eod(full, 4, eod)), (
            f"eod {eod}: {out.tolist()} vs {full.tolist()}"
        )
        assert torch.equal(out, generate(dense, prompt, 6, greedy=True, eod=eod)), (
            f"eod {eod}: dense differs"
        )
        _same_on_all_ranks(out, f"eod {eod}")
    # One sequence: it stops right after emitting eod.
    single = generate(model, prompt[:1], 6, greedy=True, eod=int(full[0, 5]))
    assert single.shape[1] <= 6 and torch.equal(
        single, _expected_with_eod(full[:1], 4, int(full[0, 5]))
    ), single.tolist()
    # Training mode restored either way; max_new_tokens=0 returns the prompt.
    model.train()
    generate(model, prompt, 1, greedy=True)
    assert model.training
    model.eval()
    assert torch.equal(generate(model, prompt, 0), prompt) and not model.training


def test_eod_and_training_mode(cpu_ranks):
    cpu_ranks.run(_eod)


def _bad_inputs(rank, world):
    setup_tp(4, replicas=True)
    _, model = _models("gpt2")
    ok = _prompt(1, 4)
    cases = [
        ("prompt must be a 2-D [batch, seq] tensor", (torch.zeros(4, dtype=torch.long), 2), {}),
        ("prompt must be int64", (ok.int(), 2), {}),
        ("prompt is empty", (torch.zeros(1, 0, dtype=torch.long), 2), {}),
        ("max_new_tokens must be an int >= 0", (ok, -1), {}),
        ("temperature must be > 0", (ok, 2), dict(temperature=0.0)),
        ("temperature must be > 0", (ok, 2), dict(temperature=-1.0)),
        ("top_k must be an int >= 1", (ok, 2), dict(top_k=0)),
        ("top_p must be in (0, 1]", (ok, 2), dict(top_p=0.0)),
        ("prompt token id 50 is out of range [0, 50)", (torch.full((1, 3), 50), 2), {}),
        ("prompt token id -1 is out of range [0, 50)", (torch.full((1, 3), -1), 2), {}),
        ("eod 50 is out of range [0, 50)", (ok, 2), dict(eod=50)),
    ]
    for match, args, kw in cases:
        expect_error(ValueError, match, generate, model, *args, **kw)
    # Sequence parallel with max_position_embeddings not divisible by TP: the padded window
    # would not fit.
    sp = GPTModel(
        dataclasses.replace(VARIANTS["gpt2"], sequence_parallel=True, max_position_embeddings=14)
    )
    expect_error(ValueError, "exceeds max_position_embeddings 14", generate, sp, _prompt(1, 12), 4)
    assert generate(sp, _prompt(1, 6), 3, greedy=True).shape == (1, 9)  # windows up to 8 still fit
    # No rank was left in a collective: generation still works.
    _same_on_all_ranks(generate(model, ok, 2, greedy=True), "after the errors")


def test_bad_inputs_raise_on_every_rank(cpu_ranks):
    cpu_ranks.run(_bad_inputs)


def _decode_matches_forward(rank, world, tp):
    """`GPTModel.decode` with its KV cache (a prompt, single tokens, then two at once) gives
    the logits a forward over the whole sequence gives at the same positions; the cache
    refuses tokens past its length and the model's positions."""
    setup_tp(tp, replicas=True)
    names = ("llama_kv1", "qwen3_kv2", "olmo_kv2", "gemma")
    variants = {**VARIANTS, **{k: GQA_VARIANTS[k] for k in names}}
    # MoE: a step's 2 tokens do not split over TP 4, so every TP rank routes both there.
    variants["moe"] = dataclasses.replace(
        VARIANTS["llama"], num_experts=4, moe_ffn_hidden_size=16, moe_layer_freq=[0, 1]
    )
    for name, config in variants.items():
        torch.manual_seed(0)
        model = GPTModel(config).eval()
        ids = _prompt(2, 9, seed=5)
        with torch.no_grad():
            full = model(ids)  # [b, s, vocab_padded / tp]
            cache = KVCache(config.max_position_embeddings)
            for lo, hi in ((0, 4), (4, 5), (5, 6), (6, 7), (7, 9)):
                got = model.decode(ids[:, lo:hi], cache)
                assert_close(got, full[:, hi - 1], f"{name} TP{tp}: tokens {lo}..{hi - 1}")
            assert cache.length == 9
    with torch.no_grad():
        short = KVCache(3)
        expect_error(ValueError, "exceed its 3", model.decode, _prompt(1, 4), short)
        long = KVCache(64)
        expect_error(
            ValueError, "exceed max_position_embeddings", model.decode, _prompt(1, 17), long
        )


@pytest.mark.parametrize("tp", [2, 4])
def test_decode_with_kv_cache_matches_forward(cpu_ranks, tp):
    cpu_ranks.run(_decode_matches_forward, tp)
