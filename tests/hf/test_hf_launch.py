"""tpcore.hf.launch and tpcore.hf.verify from the test process itself, without torchrun:
results equal the dense model's, per-rank memory while loading stays near model / TP,
a worker's exception reaches the caller, a dead worker ends the call within seconds.

The workers are forked from the tests' warm server (launch.warm_context) instead of spawned,
which spends about 5 s of CPU per worker importing torch, transformers and tpcore; the test of
a killed caller starts its workers the real way, by spawn."""

from __future__ import annotations

import os
import time

import pytest
import torch
import transformers

import tpcore.hf
from checks import assert_close
from hf_families import save_family
from launch import warm_context
from tpcore.hf.tensor_parallel import launcher

TP = 2


@pytest.fixture(scope="module", autouse=True)
def warm_workers():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launcher, "_worker_context", warm_context)
        yield


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, int]:
    """A Llama of ~74 MB (fp32, vocab 32000, untied head) saved with save_pretrained;
    (path, bytes)."""
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    path = str(tmp_path_factory.mktemp("llama74"))
    model.save_pretrained(path)
    return path, sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture(scope="module")
def handle(saved):
    with tpcore.hf.launch(saved[0], TP, timeout=120) as h:
        yield h


def test_launch_matches_dense(saved, handle):
    path, _ = saved
    dense = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(0, 32000, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = dense(ids).logits
    got = handle(ids)
    assert_close(got.logits, want, "logits from the launched workers")
    assert got.past_key_values is None, "the KV cache should not travel back"
    assert torch.equal(
        handle.generate(ids, max_new_tokens=10),
        dense.generate(ids, max_new_tokens=10, do_sample=False),
    )


def test_load_memory_per_rank_near_model_over_tp(saved, handle):
    """Each fresh worker's resident-memory peak while loading (VmHWM minus VmRSS before):
    its shard (model / TP) plus a little, far from the whole model."""
    _, model_bytes = saved
    mib = 2**20
    for rank, stats in enumerate(handle.load_stats):
        grown = (stats["peak_rss_kib"] - stats["rss_before_kib"]) * 1024
        assert grown > 0.4 * model_bytes / TP, (
            f"rank {rank}: {grown / mib:.1f} MiB is less than its shard: not measured?"
        )
        assert grown < model_bytes / TP + 12 * mib, (
            f"rank {rank}: peak {grown / mib:.1f} MiB > shard {model_bytes / TP / mib:.1f} MiB + 12"
        )
        assert grown < 0.75 * model_bytes, (
            f"rank {rank}: peak {grown / mib:.1f} MiB is near the whole model"
        )


def _fail_on_rank(model, rank_to_fail):
    import torch.distributed as dist

    if dist.get_rank() == rank_to_fail:
        raise ValueError(f"boom on rank {rank_to_fail}")
    return "fine"


def _tp_size(model):
    return model.tpcore_plan.layout.tp_size


def test_worker_exception_reaches_caller(handle):
    with pytest.raises(tpcore.hf.WorkerError) as info:
        handle.run(_fail_on_rank, 1)
    message = str(info.value)
    assert "boom on rank 1" in message and "Traceback" in message and "rank 1" in message
    assert handle.run(_tp_size) == TP, "the workers should still serve calls after a clean failure"


def _unpicklable_result(model):
    return lambda: None


def test_unpicklable_call_or_result_fails_at_once(handle):
    start = time.monotonic()
    with pytest.raises(TypeError, match="must be picklable"):
        handle.run(lambda model: 1)
    with pytest.raises(tpcore.hf.WorkerError, match="Can't pickle|cannot pickle"):
        handle.run(_unpicklable_result)
    assert time.monotonic() - start < 10, "the call waited for answers that could never come"
    assert handle.run(_tp_size) == TP, "the workers should still serve calls"


_ORPHAN_SCRIPT = """
import sys, time
import tpcore.hf
if __name__ == "__main__":  # the spawned workers import this file too
    handle = tpcore.hf.launch(sys.argv[1], 2, timeout=120)
    print(" ".join(str(p.pid) for p in handle._procs), flush=True)
    time.sleep(600)
"""


def test_workers_exit_when_the_caller_is_killed(saved, tmp_path):
    """A caller killed without close() (SIGKILL, a notebook kernel restart) leaves no worker
    behind."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "caller.py"
    script.write_text(_ORPHAN_SCRIPT)
    caller = subprocess.Popen(
        [sys.executable, str(script), saved[0]], stdout=subprocess.PIPE, text=True
    )
    try:
        pids = [int(p) for p in caller.stdout.readline().split()]
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait(timeout=30)
    assert len(pids) == 2, pids

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split()[2] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 20
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"workers {left} outlived their killed caller"


def _exit_on_rank(model, rank_to_die):
    import torch.distributed as dist

    if dist.get_rank() == rank_to_die:
        os._exit(3)
    dist.barrier()  # the other rank waits in a collective, as a real call would
    return "unreachable"


def test_dead_worker_ends_call_in_seconds(handle):
    start = time.monotonic()
    with pytest.raises(tpcore.hf.WorkerError, match="rank 1 exit code 3"):
        handle.run(_exit_on_rank, 1)
    assert time.monotonic() - start < 10
    assert handle.closed
    with pytest.raises(RuntimeError, match="closed"):
        handle.run(_tp_size)


def test_launch_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        tpcore.hf.launch(str(tmp_path), 0)
    with pytest.raises(FileNotFoundError, match="save_pretrained folder"):
        tpcore.hf.launch(str(tmp_path / "missing"), 2)


def test_verify_console_script(tmp_path, capsys):
    """tpcore-hf-verify on a GPT-2: every hidden state, logits and greedy ids match; exit
    status 0."""
    path = save_family("gpt2", tmp_path)
    assert (
        tpcore.hf.verify_main([path, "--tensor-parallel-size", "2", "--max-new-tokens", "6"]) == 0
    )
    printed = capsys.readouterr().out
    assert "hidden_states[2]" in printed and "logits" in printed and "OK" in printed
    assert "greedy ids (tpcore.hf.generate): identical" in printed


def test_verify_console_script_names_a_folder_it_cannot_load(tmp_path, capsys):
    """A config that contradicts the weights: one line naming the folder, exit status 2."""
    import json

    path = save_family("gpt2", tmp_path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["n_embd"] *= 2
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    assert tpcore.hf.verify_main([path, "--tensor-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert f"transformers cannot load the dense model from {path}" in err and "Traceback" not in err


def test_verify_names_first_divergence():
    from tpcore.hf.tensor_parallel.verify import _compare

    base = {f"hidden_states[{i}]": torch.ones(2, 3, 4) for i in range(3)} | {
        "logits": torch.ones(2, 3, 5)
    }
    broken = {k: v.clone() for k, v in base.items()}
    broken["hidden_states[1]"][0, 0, 0] += (
        0.5  # layer 0's output diverges, and so does everything after
    )
    broken["hidden_states[2]"] += 0.5
    report = _compare(base, broken, 2, 1e-4, None)
    assert not report.ok and report.first_divergence == "hidden_states[1]"
    assert "FAILED: first divergence at hidden_states[1]" in str(report)
    assert _compare(base, base, 2, 1e-4, None).ok


def test_verify_ignores_the_checkpoints_generation_config(tmp_path):
    """A repetition penalty in generation_config.json changes model.generate, not the split:
    verify compares plain greedy on both sides and passes."""
    path = save_family("qwen2", tmp_path)
    transformers.GenerationConfig(repetition_penalty=1.3).save_pretrained(path)
    report = tpcore.hf.verify(path, tensor_parallel_size=2, max_new_tokens=8)
    assert report.ok, str(report)


def test_stopping_workers_that_never_started_is_quiet(tmp_path):
    """A launch that failed before starting every worker (e.g. a script without the
    __main__ guard) printed "can only join a started process" from its cleanup."""
    import multiprocessing as mp

    from tpcore._workers import stop_workers

    started = mp.get_context("spawn").Process(target=print)
    started.start()
    never = mp.get_context("spawn").Process(target=print)
    stop_workers([started, never], None, str(tmp_path / "scratch"))
    assert not started.is_alive()
