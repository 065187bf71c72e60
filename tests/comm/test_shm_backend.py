"""The `tpcore` shared-memory c10d backend against values computed from every rank's
contribution: every fast op, dtype, group size 1-4, sizes from one element to several
times the segment's slot, non-contiguous tensors; results identical on every rank bit for
bit; threads, async ops out of order, point-to-point tags and sizes, mismatched calls,
and the choice between shared memory and gloo (hosts, opt-out)."""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time

import pytest
import torch
import torch.distributed as dist

import tpcore
from checks import expect_error

SLOT_BYTES = 4096  # small, so that most sizes below take several steps
FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INTS = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
# Sum of up to 4 ranks, each rounded once to the dtype at the end (fp32 accumulation).
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2**-7, torch.float16: 2**-10}


class _env:
    """Environment variables set for the duration of a block (inside a rank)."""

    def __init__(self, **values: str) -> None:
        self.values, self.saved = values, {}

    def __enter__(self):
        for k, v in self.values.items():
            self.saved[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _groups(rank: int, world: int, stream_bytes: str = "0") -> dict[int, dist.ProcessGroup]:
    """A shared-memory group of ranks [0, k) for every k (created by every rank, in order).
    `stream_bytes` "1": every reduce-scatter writes its output with streaming stores (where
    a streaming loop exists: float32 sum or average over two ranks)."""
    groups = {}
    with _env(
        TPCORE_SHM_SLOT_BYTES=str(SLOT_BYTES),
        TPCORE_SHM_CELL_BYTES="1024",
        TPCORE_SHM_TWO_STEP_BYTES="2048",
        TPCORE_SHM_STREAM_BYTES=stream_bytes,
    ):
        for k in range(1, world + 1):
            g = dist.new_group(list(range(k)), backend="tpcore")
            if rank < k:
                assert tpcore.shm.shm_backend_of(g) is not None, (
                    "a one-host group must use shared memory"
                )
                groups[k] = g
    return groups


def _contribution(r: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + r)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    low = 0 if dtype == torch.uint8 else -3
    return torch.randint(low, 4, (n,), generator=g).to(dtype)


def _as_input(t: torch.Tensor, contiguous: bool) -> torch.Tensor:
    """`t` itself, or a strided view with the same values."""
    if contiguous:
        return t.clone()
    wide = torch.zeros(t.numel(), 2, dtype=t.dtype)
    wide[:, 0] = t
    view = wide[:, 0]
    assert not view.is_contiguous() or t.numel() <= 1
    return view


def _check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if want.dtype.is_floating_point:
        scale = max(want.double().abs().max().item() if want.numel() else 0.0, 1.0)
        tol = TOL[want.dtype]
        torch.testing.assert_close(
            got, want, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}"
        )
    else:
        assert torch.equal(got, want), f"{what}: {got} != {want}"


def _digest(digests: list, t: torch.Tensor) -> None:
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(
        t.reshape(-1)
    )  # stride 1 even for one element
    digests.append(hashlib.sha1(flat.view(torch.uint8).numpy().tobytes()).hexdigest())


REDUCE_OPS = {
    "sum": (dist.ReduceOp.SUM, lambda xs: torch.stack(xs).sum(0)),
    "avg": (dist.ReduceOp.AVG, lambda xs: torch.stack(xs).mean(0)),
    "max": (dist.ReduceOp.MAX, lambda xs: torch.stack(xs).amax(0)),
    "min": (dist.ReduceOp.MIN, lambda xs: torch.stack(xs).amin(0)),
    "product": (dist.ReduceOp.PRODUCT, lambda xs: torch.stack(xs).prod(0)),
}


def _every_op(rank, world, stream_bytes):
    groups = _groups(rank, world, stream_bytes)
    digests: dict[int, list] = {k: [] for k in groups}
    for k, group in groups.items():
        for di, dtype in enumerate(FLOATS + INTS):
            es = torch.empty(0, dtype=dtype).element_size()
            for ni, n in enumerate((1, 7 * k, 3 * SLOT_BYTES // es + 5 * k)):
                for contiguous in (True, False):
                    # The same on every rank of the group (ranks join different numbers of groups).
                    seed = ((k * 20 + di) * 4 + ni) * 2 + contiguous
                    xs = [_contribution(r, n, dtype, seed) for r in range(k)]
                    what = f"k={k} {dtype} n={n} contiguous={contiguous}"
                    wide = [x.double() if dtype.is_floating_point else x.long() for x in xs]
                    for name, (op, ref) in REDUCE_OPS.items():
                        if name == "avg" and not dtype.is_floating_point:
                            continue
                        if name == "product" and dtype.is_floating_point and n > 7 * k:
                            continue  # products of many randn values under/overflow fp16
                        t = _as_input(xs[rank], contiguous)
                        dist.all_reduce(t, op=op, group=group)
                        _check(t, ref(wide).to(dtype), f"all_reduce {name} {what}")
                        _digest(digests[k], t)
                    # all_gather, into a tensor and into a list
                    out = torch.empty(k * n, dtype=dtype)
                    dist.all_gather_into_tensor(out, _as_input(xs[rank], contiguous), group=group)
                    _check(out, torch.cat(xs), f"all_gather_into_tensor {what}")
                    outs = [_as_input(torch.zeros(n, dtype=dtype), contiguous) for _ in range(k)]
                    dist.all_gather(outs, xs[rank], group=group)
                    _check(torch.cat(outs), torch.cat(xs), f"all_gather {what}")
                    # reduce_scatter: rank r's input is k chunks of n; it keeps the sum of
                    # chunk `rank`
                    ins = [
                        torch.cat([_contribution(r * 10 + c, n, dtype, seed) for c in range(k)])
                        for r in range(k)
                    ]
                    want = torch.stack(
                        [x.double() if dtype.is_floating_point else x.long() for x in ins]
                    ).sum(0)
                    want = want.view(k, n)[rank].to(dtype)
                    got = _as_input(torch.zeros(n, dtype=dtype), contiguous)
                    dist.reduce_scatter_tensor(got, _as_input(ins[rank], contiguous), group=group)
                    _check(got, want, f"reduce_scatter_tensor {what}")
                    got = torch.zeros(n, dtype=dtype)
                    dist.reduce_scatter(got, list(ins[rank].view(k, n).unbind(0)), group=group)
                    _check(got, want, f"reduce_scatter {what}")
                    if contiguous:  # in place, as Megatron's distributed optimizer calls them
                        buffer = ins[rank].clone()
                        dist.reduce_scatter_tensor(buffer.view(k, n)[rank], buffer, group=group)
                        _check(
                            buffer.view(k, n)[rank],
                            want,
                            f"reduce_scatter_tensor into its own input {what}",
                        )
                        # Same arithmetic in the same order whether or not the output is an input.
                        assert torch.equal(buffer.view(k, n)[rank], got), (
                            f"in-place reduce_scatter differs in bits {what}"
                        )
                        buffer = torch.zeros(k * n, dtype=dtype)
                        buffer.view(k, n)[rank] = xs[rank]
                        dist.all_gather_into_tensor(buffer, buffer.view(k, n)[rank], group=group)
                        _check(
                            buffer,
                            torch.cat(xs),
                            f"all_gather_into_tensor from its own output {what}",
                        )
                    # broadcast from every root
                    for root in range(k):
                        t = _as_input(xs[rank], contiguous)
                        dist.broadcast(t, src=root, group=group)  # global rank == group rank here
                        _check(t, xs[root], f"broadcast from {root} {what}")
                    # all_to_all: chunk c of rank r's input goes to rank c
                    a2a_in = [_contribution(r * 10 + 5, k * n, dtype, seed) for r in range(k)]
                    got = torch.empty(k * n, dtype=dtype)
                    dist.all_to_all_single(got, a2a_in[rank], group=group)
                    _check(
                        got,
                        torch.cat([a2a_in[r].view(k, n)[rank] for r in range(k)]),
                        f"all_to_all {what}",
                    )
        dist.barrier(group=group)
        backend = tpcore.shm.shm_backend_of(group)
        assert backend.fallback_ops == 0, "every op above has a shared-memory path"
        assert backend.fast_ops > 0
    return digests


@pytest.mark.parametrize("stream_bytes", ["0", "1"], ids=["plain_stores", "streaming_stores"])
def test_every_op_dtype_size_and_group_size(cpu_ranks, stream_bytes):
    digests = cpu_ranks.run(_every_op, stream_bytes, timeout=600)
    for k in range(1, 5):
        ranks = [digests[r][k] for r in range(k)]
        assert all(d == ranks[0] for d in ranks), f"group of {k}: results differ between ranks"


def _streaming_matches_plain(rank, world):
    # Outputs one element past an aligned address, so the streaming loop has an unaligned
    # head and tail.
    plain, streaming = _groups(rank, world, "0"), _groups(rank, world, "1")
    for k in plain:
        for dtype in FLOATS + INTS[:1]:
            n = 3 * SLOT_BYTES // torch.empty(0, dtype=dtype).element_size() + 5
            x = _contribution(rank, k * n + 1, dtype, seed=k)[1:]
            ops = (
                (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX)
                if dtype.is_floating_point
                else (dist.ReduceOp.SUM,)
            )
            for op in ops:
                got = [torch.zeros(n + 1, dtype=dtype)[1:] for _ in range(2)]
                for out, group in zip(got, (plain[k], streaming[k])):
                    dist.reduce_scatter_tensor(out, x, op=op, group=group)
                assert torch.equal(got[0], got[1]), (
                    f"reduce_scatter k={k} {dtype} {op}: streaming changes the bits"
                )
    return True


def test_streaming_stores_give_the_same_bits(cpu_ranks):
    cpu_ranks.run(_streaming_matches_plain)


def _fallback_and_errors(rank, world):
    group = dist.new_group(list(range(world)), backend="tpcore")
    backend = tpcore.shm.shm_backend_of(group)
    # Ops without a shared-memory path go to gloo and still work.
    flags = torch.tensor([rank % 2 == 0, True])
    dist.all_reduce(flags, group=group)  # bool: gloo
    assert flags.tolist() == [True, True]
    t = torch.tensor([0b0110 | (1 << rank)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.BAND, group=group)
    assert t.item() == 0b0110 if world > 1 else t.item() == 0b0111
    gathered = [torch.zeros(2) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), gathered, dst=0, group=group)
    if rank == 0:
        assert [g[0].item() for g in gathered] == list(range(world))
    assert backend.fallback_ops >= 3
    # Mismatched calls: a clear error on every rank, and the group stays usable.
    n = 10 if rank == 0 else 12
    expect_error(ValueError, "mismatched collectives", dist.all_reduce, torch.ones(n), group=group)
    expect_error(
        ValueError,
        "mismatched collectives",
        dist.broadcast,
        torch.ones(3),
        src=rank % 2,
        group=group,
    )
    x = torch.ones(5)
    dist.all_reduce(x, group=group)
    assert x.tolist() == [float(world)] * 5
    # Bad shapes raise before anything is exchanged.
    expect_error(
        ValueError,
        "elements",
        dist.all_gather_into_tensor,
        torch.empty(3),
        torch.ones(2),
        group=group,
    )
    return True


def test_fallback_to_gloo_and_clear_errors(cpu_ranks):
    cpu_ranks.run(_fallback_and_errors)


def _threads_and_async(rank, world):
    # Two groups over the same ranks, driven from two threads at once.
    pair = [dist.new_group([0, 1], backend="tpcore") for _ in range(2)] + [
        dist.new_group([2, 3], backend="tpcore") for _ in range(2)
    ]
    mine = pair[:2] if rank < 2 else pair[2:]
    errors, results = [], {}

    def run(i):
        try:
            acc = 0.0
            for step in range(200):
                x = torch.full((64 * (i + 1),), float(rank + step))
                dist.all_reduce(x, group=mine[i])
                acc += x[0].item()
            results[i] = acc
        except Exception as e:  # noqa: BLE001 - reported to the test below
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    pair_sum = sum(range(rank - rank % 2, rank - rank % 2 + 2))
    want = sum(pair_sum + 2 * step for step in range(200))
    assert results == {0: want, 1: want}, results
    # Async ops waited on in reverse order.
    group = dist.new_group(list(range(world)), backend="tpcore")
    a = torch.full((1000,), float(rank))
    out = torch.empty(world * 3)
    w1 = dist.all_reduce(a, group=group, async_op=True)
    w2 = dist.all_gather_into_tensor(out, torch.full((3,), float(rank)), group=group, async_op=True)
    w2.wait()
    w1.wait()
    assert a[0].item() == sum(range(world))
    assert out.tolist() == [float(r) for r in range(world) for _ in range(3)]
    fut = dist.all_reduce(torch.ones(4), group=group, async_op=True).get_future()
    assert fut.wait()[0].tolist() == [float(world)] * 4
    return True


def test_threads_and_async_ops(cpu_ranks):
    cpu_ranks.run(_threads_and_async)


def _p2p(rank, world):
    with _env(TPCORE_SHM_CELL_BYTES="1024", TPCORE_SHM_CELLS="2"):
        group = dist.new_group(list(range(world)), backend="tpcore")
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    # A ring of messages much larger than a link (2 cells of 1 KiB), both ways at once.
    big = torch.arange(50_000, dtype=torch.float32) + rank
    small = torch.arange(7, dtype=torch.int64) * (rank + 1)
    got_big, got_small = torch.empty(50_000), torch.empty(7, dtype=torch.int64)
    ops = [
        dist.P2POp(dist.isend, big, nxt, group=group, tag=1),
        dist.P2POp(dist.isend, small, prv, group=group, tag=2),
        dist.P2POp(dist.irecv, got_big, prv, group=group, tag=1),
        dist.P2POp(dist.irecv, got_small, nxt, group=group, tag=2),
    ]
    reqs = dist.batch_isend_irecv(ops)
    for req in reversed(reqs):
        req.wait()
    assert torch.equal(got_big, torch.arange(50_000, dtype=torch.float32) + prv)
    assert torch.equal(got_small, torch.arange(7) * (nxt + 1))
    # The same ring with the ops issued and waited on in random orders (different on each
    # rank): a rank waiting for one peer must drain the others (this deadlocked once).
    rng = random.Random(rank)
    for it in range(40):
        n = (1, 100, 5000, 50_000)[it % 4]
        big, small = (
            torch.arange(n, dtype=torch.float32) + rank + it,
            torch.arange(7) * (rank + 1) + it,
        )
        got_big, got_small = torch.empty(n), torch.empty(7, dtype=torch.int64)
        ops = [
            dist.P2POp(dist.isend, big, nxt, group=group, tag=1),
            dist.P2POp(dist.isend, small, prv, group=group, tag=2),
            dist.P2POp(dist.irecv, got_big, prv, group=group, tag=1),
            dist.P2POp(dist.irecv, got_small, nxt, group=group, tag=2),
        ]
        rng.shuffle(ops)
        reqs = dist.batch_isend_irecv(ops)
        rng.shuffle(reqs)
        for req in reqs:
            req.wait()
        assert torch.equal(got_big, torch.arange(n, dtype=torch.float32) + prv + it), it
        assert torch.equal(got_small, torch.arange(7) * (nxt + 1) + it), it
    # Tags match out of order; a non-contiguous receive buffer is filled.
    if rank == 0:
        dist.send(torch.full((3,), 5.0), 1, group=group, tag=5)
        dist.send(torch.full((3,), 7.0), 1, group=group, tag=7)
        dist.send(torch.zeros(4), 1, group=group, tag=9)  # the receiver expects 5 elements
    elif rank == 1:
        seven = torch.zeros(3, 2)[:, 1]
        w7 = dist.irecv(seven, 0, group=group, tag=7)
        five = torch.zeros(3)
        dist.recv(five, 0, group=group, tag=5)
        w7.wait()
        assert five.tolist() == [5.0] * 3 and seven.tolist() == [7.0] * 3
        expect_error(
            ValueError,
            "expected a message of 20 bytes",
            dist.recv,
            torch.zeros(5),
            0,
            group=group,
            tag=9,
        )
    # A send larger than the link returns at once (the rest is queued and written as the
    # peer drains the link): rank 0 is not held up while rank 1 is busy elsewhere. Messages
    # to one peer keep their order, the monitored barrier's own sends included.
    big = torch.arange(50_000, dtype=torch.float32)
    if rank == 0:
        start = time.monotonic()
        sent = dist.isend(big, 1, group=group, tag=11)
        posted = time.monotonic() - start
        dist.send(torch.full((3,), 3.0), 1, group=group, tag=13)
    elif rank == 1:
        time.sleep(1.0)
        small, got = torch.zeros(3), torch.empty(50_000)
        dist.recv(small, 0, group=group, tag=13)
        dist.recv(got, 0, group=group, tag=11)
        assert torch.equal(got, big) and small.tolist() == [3.0] * 3
    dist.monitored_barrier(group=group)
    if rank == 0:
        sent.wait()
        assert posted < 0.5, f"isend of 200 KB through a 2 KB link blocked {posted:.2f} s"
    # The links are still in step after the size error.
    x = torch.full((2,), float(rank))
    dist.all_reduce(x, group=group)
    assert x[0].item() == sum(range(world))
    return True


def test_point_to_point(cpu_ranks):
    cpu_ranks.run(_p2p)


def _hosts_and_opt_out(rank, world):
    # Ranks posing as two hosts: a group across them is plain gloo; groups within one host
    # use shared memory. tpcore's own groups follow the same rule. (TPCORE_CPU_BACKEND is
    # set here, since the suite also runs with it set to gloo.)
    with _env(TPCORE_HOST_ID=f"host{rank // 2}", TPCORE_CPU_BACKEND="tpcore"):
        across = dist.new_group(list(range(world)), backend="tpcore")
        assert tpcore.shm.shm_backend_of(across) is None
        x = torch.full((3,), float(rank))
        dist.all_reduce(x, group=across)
        assert x[0].item() == sum(range(world))
        tpcore.initialize_model_parallel(tensor_parallel_size=2)
        state = tpcore.parallel_state.get_parallel_state()
        assert tpcore.shm.shm_backend_of(state.tensor_group) is not None  # ranks {0,1} / {2,3}
        assert tpcore.shm.shm_backend_of(state.data_group) is None  # ranks {0,2} / {1,3}
        tpcore.destroy_model_parallel()
    with _env(TPCORE_CPU_BACKEND="gloo"):
        tpcore.initialize_model_parallel(tensor_parallel_size=2)
        assert (
            tpcore.shm.shm_backend_of(tpcore.parallel_state.get_tensor_model_parallel_group())
            is None
        )
        tpcore.destroy_model_parallel()
    with _env(TPCORE_CPU_BACKEND="tpcore"):
        tpcore.initialize_model_parallel(tensor_parallel_size=4)
    assert (
        tpcore.shm.shm_backend_of(tpcore.parallel_state.get_tensor_model_parallel_group())
        is not None
    )
    return True


def test_host_identity_and_opt_out(cpu_ranks):
    cpu_ranks.run(_hosts_and_opt_out)


def test_bad_opt_out_value_is_named(monkeypatch):
    monkeypatch.setenv("TPCORE_CPU_BACKEND", "mpi")
    with pytest.raises(ValueError, match="TPCORE_CPU_BACKEND"):
        tpcore.shm.cpu_backend_for([0], ["h"])


def test_bad_tuning_values_are_named(monkeypatch):
    monkeypatch.setenv("TPCORE_SHM_STREAM_BYTES", "0")  # 0 means never stream: allowed
    assert tpcore.shm._env_int("TPCORE_SHM_STREAM_BYTES", -1, minimum=0) == 0
    for name, value, minimum in (
        ("TPCORE_SHM_STREAM_BYTES", "-5", 0),
        ("TPCORE_SHM_SLOT_BYTES", "0", 1),
        ("TPCORE_SHM_CELLS", "4k", 1),
    ):
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=name):
            tpcore.shm._env_int(name, 1, minimum=minimum)


def _layer_batch_mismatch(rank, world):
    # Issue 22 item 8: a different batch size per rank into RowParallelLinear aborted the
    # process inside gloo; on the shared-memory backend the step header names the mismatch.
    with _env(TPCORE_CPU_BACKEND="tpcore"):  # the suite also runs with gloo as the default
        tpcore.initialize_model_parallel(tensor_parallel_size=world)
    layer = tpcore.RowParallelLinear(8 * world, 4, input_is_parallel=True)
    expect_error(ValueError, "mismatched collectives", layer, torch.randn(2 + rank % 2, 8))
    # Same shapes afterwards: the group is still usable.
    assert layer(torch.randn(3, 8)).shape == (3, 4)
    return True


def test_layer_inputs_of_different_sizes_raise_on_every_rank(cpu_ranks):
    cpu_ranks.run(_layer_batch_mismatch)
