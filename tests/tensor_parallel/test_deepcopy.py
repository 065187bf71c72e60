"""`copy.deepcopy` of split models (a frozen reference model for DPO, an EMA copy): the copy
shares the process group, owns its weights, computes what the original does, and its
backward gives the original's gradients (tpcore.hf's gradient sums of copied KV heads and
MoE routers included: without them the replicated gradients would differ)."""

from __future__ import annotations

import copy

import torch

from checks import assert_close
from hf_families import FAMILIES, prompt, save_family


def _groups(model) -> list:
    return [m.group for m in model.modules() if hasattr(m, "group")]


def _check_copy(original, clone, loss_of, what: str, after_backward=lambda m: None) -> None:
    assert _groups(clone) and all(a is b for a, b in zip(_groups(clone), _groups(original))), (
        f"{what}: groups not shared"
    )
    for (n, p), q in zip(original.named_parameters(), clone.parameters()):
        assert p is not q and p.data_ptr() != q.data_ptr() and torch.equal(p, q), (
            f"{what}: {n} not copied"
        )
        assert vars(q) == vars(p), (
            f"{what}: {n}'s attributes {vars(q)} != {vars(p)}"
        )  # tpcore's tags (sequence_parallel, ...)
    losses = []
    for m in (original, clone):
        m.zero_grad()
        loss = loss_of(m)
        loss.backward()
        after_backward(m)
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1]), f"{what}: loss {losses[1]} != {losses[0]}"
    for (n, p), q in zip(original.named_parameters(), clone.parameters()):
        assert_close(q.grad, p.grad, f"{what}: grad of {n}")
    before = loss_of(original).detach()
    with torch.no_grad():
        for q in clone.parameters():
            q -= 0.5 * q.grad
    assert torch.equal(loss_of(original).detach(), before), (
        f"{what}: a step on the copy changed the original"
    )
    assert not torch.equal(loss_of(clone).detach(), before), (
        f"{what}: the step did not change the copy"
    )


def _hf_job(rank, world, paths):
    import tpcore
    import tpcore.hf

    ids = prompt(seq=9)
    for name, path in paths.items():
        tpcore.initialize_model_parallel(
            tensor_parallel_size=4
        )  # llama: KV heads copied, their gradients summed
        model = tpcore.hf.from_pretrained(path, model_class=FAMILIES[name][0]).train()
        clone = copy.deepcopy(model)
        _check_copy(model, clone, lambda m: m(input_ids=ids, labels=ids).loss, f"{name} TP=4")
        tpcore.destroy_model_parallel()
    return True


def test_split_hf_models_deep_copy(cpu_ranks, tmp_path):
    paths = {name: save_family(name, tmp_path / name) for name in ("llama", "mixtral")}
    assert all(cpu_ranks.run(_hf_job, paths))


def _gpt_job(rank, world):
    import tpcore
    from tpcore.models import GPTConfig, GPTModel, finalize_sequence_parallel_grads

    tpcore.initialize_model_parallel(tensor_parallel_size=2)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    for sequence_parallel in (
        False,
        True,
    ):  # the norms' gradients summed over TP only where they are tagged
        torch.manual_seed(0)
        config = GPTConfig(
            vocab_size=50,
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_kv_heads=1,
            qk_norm=True,
            position_embedding="rotary",
            norm="rmsnorm",
            sequence_parallel=sequence_parallel,
        )
        model = GPTModel(config)
        finalize = finalize_sequence_parallel_grads if sequence_parallel else (lambda m: None)
        _check_copy(
            model,
            copy.deepcopy(model),
            lambda m: m(ids, ids),
            f"GPTModel TP=2 sp={sequence_parallel}",
            finalize,
        )
    tpcore.destroy_model_parallel()
    return True


def test_gpt_model_deep_copies(cpu_ranks):
    assert all(cpu_ranks.run(_gpt_job))
