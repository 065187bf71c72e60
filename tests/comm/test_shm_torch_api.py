"""The `tpcore` backend under torch.distributed calls that are not plain collectives:
receives from any source, monitored_barrier (passing, and naming late ranks within its
timeout), c10d sequence numbers and object collectives on subgroups, ending groups after
operations that went through the gloo fallback, and ranks that disagree on the backend."""

from __future__ import annotations

import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import tpcore
from launch import warm_context
from rank_pool import run_fresh_processes


def _any_source(rank, world):
    g = dist.new_group(list(range(world)), backend="tpcore")
    peers = range(1, world)
    if rank == 0:
        # dist.recv without src returns the sender's rank; irecv's work names it too
        got = {}
        for _ in peers:
            t = torch.zeros(5)
            src = dist.recv(t, group=g)
            got[src] = t
        assert sorted(got) == list(peers), got
        for src, t in got.items():
            assert torch.equal(t, torch.full((5,), float(src))), (src, t)
        # messages that arrived before the receive was posted, several cells long (and
        # within a link's 1 MiB, so that the senders are not waiting for room)
        dist.barrier()  # the peers have sent
        time.sleep(0.2)
        for _ in peers:
            t = torch.zeros(200_000)
            work = dist.irecv(t, group=g, tag=3)
            work.wait()
            src = work._source_rank()
            assert torch.equal(t, torch.arange(200_000, dtype=torch.float32) + src), src
        # a receive from one rank and one from any rank, posted in that order: rank 2's first
        # message goes to the first, its second to the second
        specific, any_rank = torch.zeros(2), torch.zeros(2)
        w1 = dist.irecv(specific, src=2, group=g, tag=7)
        w2 = dist.irecv(any_rank, group=g, tag=7)
        dist.barrier()  # rank 2 sends after this
        w1.wait()
        w2.wait()
        assert specific.tolist() == [1.0, 1.0] and any_rank.tolist() == [2.0, 2.0], (
            specific,
            any_rank,
        )
        assert w2._source_rank() == 2
    else:
        dist.send(torch.full((5,), float(rank)), dst=0, group=g)
        dist.send(torch.arange(200_000, dtype=torch.float32) + rank, dst=0, group=g, tag=3)
        dist.barrier()
        dist.barrier()  # rank 0 has posted its receives with tag 7
        if rank == 2:
            dist.send(torch.ones(2), dst=0, group=g, tag=7)
            dist.send(torch.full((2,), 2.0), dst=0, group=g, tag=7)
    assert tpcore.shm.shm_backend_of(g).fallback_ops == 0, "a receive from any source went to gloo"
    dist.destroy_process_group(g)


def test_recv_from_any_source(cpu_ranks):
    cpu_ranks.run(_any_source)


def _monitored_barrier(rank, world, late, wait_all):
    g = dist.new_group(list(range(world)), backend="tpcore")
    for _ in range(3):  # on time: passes, through shared memory
        dist.monitored_barrier(g, timeout=timedelta(seconds=30), wait_all_ranks=wait_all)
    assert tpcore.shm.shm_backend_of(g).fallback_ops == 0
    dist.barrier()
    if rank in late:
        time.sleep(2.0)
    start = time.monotonic()
    try:
        dist.monitored_barrier(g, timeout=timedelta(seconds=0.5), wait_all_ranks=wait_all)
        outcome = "passed"
    except Exception as e:  # noqa: BLE001 - the error is what the test checks
        outcome = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - start
    dist.destroy_process_group(g)
    return outcome, elapsed


def test_monitored_barrier_names_the_late_rank_within_its_timeout(cpu_ranks):
    for late, wait_all, named in (((2,), False, "Rank 2 "), ((2, 3), True, "Ranks 2, 3 ")):
        answers = cpu_ranks.run(_monitored_barrier, late, wait_all)
        want = f"[Rank 0]: {named}failed to pass monitoredBarrier in 500 ms"
        for rank, (outcome, elapsed) in enumerate(answers):
            assert outcome.startswith("DistBackendError") and want in outcome, (rank, outcome)
            if rank:  # gloo's words, which torch's own tests match
                assert (
                    f"Rank {rank} successfully reached monitoredBarrier, "
                    "but received errors while waiting for send/recv from rank 0"
                ) in outcome, outcome
            # rank 0 gives up after the barrier's 0.5 s; the others raise as soon as it does
            # (the late ranks as soon as they arrive)
            assert elapsed < 1.8, (rank, elapsed, outcome)


def _monitored_barrier_without_time(rank, world):
    g = dist.new_group(list(range(world)), backend="tpcore")
    outcome = "not called"
    if rank == 0:  # a timeout spent before any rank's turn is rank 0's own, as gloo says
        try:
            dist.monitored_barrier(g, timeout=timedelta(seconds=0))
            outcome = "passed"
        except Exception as e:  # noqa: BLE001 - the error is what the test checks
            outcome = f"{type(e).__name__}: {e}"
    dist.destroy_process_group(g)
    return outcome


def test_monitored_barrier_with_no_time_left_names_rank_0(cpu_ranks):
    outcome = cpu_ranks.run(_monitored_barrier_without_time)[0]
    assert "Rank 0 timed out in monitoredBarrier after 0 ms" in outcome, outcome


def _one_rank_subgroups(rank, world):
    """torch's test_new_subgroups_with_group_param: one-rank subgroups made apart by the two
    halves get the same name (torch counts groups), so they share a store prefix."""

    def meet(*args):  # the other half's rank list may be in the shared keys (a race)
        raise AssertionError("a one-rank group met other ranks through its store")

    for _ in range(3):
        half, halves = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]], backend="tpcore")
        real, tpcore.shm._hosts = tpcore.shm._hosts, meet
        try:
            mine, singles = dist.new_subgroups(group_size=1, group=half, backend="tpcore")
        finally:
            tpcore.shm._hosts = real
        assert mine.size() == 1 and len(singles) == 2
        t = torch.full((3,), float(rank))
        dist.all_reduce(t, group=mine)
        assert torch.equal(t, torch.full((3,), float(rank)))
        dist.all_reduce(t, group=half)
        assert torch.equal(t, torch.full((3,), float(2 * (rank % 2) + 2)))
        for g in singles + halves:
            dist.destroy_process_group(g)


def test_one_rank_subgroups_sharing_a_name(cpu_ranks):
    cpu_ranks.run(_one_rank_subgroups)


def _sequence_numbers(rank, world):
    g = dist.new_group(list(range(world)), backend="tpcore")
    before = g._get_sequence_number_for_group()
    dist.all_reduce(torch.ones(3), group=g)
    dist.broadcast(torch.ones(3), src=0, group=g)
    dist.scatter(
        torch.zeros(2), [torch.ones(2)] * world if rank == 0 else None, src=0, group=g
    )  # gloo's
    dist.barrier(group=g)
    after = g._get_sequence_number_for_group()
    numbers = [None] * world
    dist.all_gather_object(numbers, (before, after))
    assert all(n == numbers[0] for n in numbers), (
        f"sequence numbers differ between ranks: {numbers}"
    )
    assert after - before == 4, (before, after)
    # object collectives on a subgroup use them
    pair = dist.new_group([0, 1], backend="tpcore")
    if rank < 2:
        objects = [None, None]
        dist.all_gather_object(objects, {"rank": rank}, group=pair)
        assert objects == [{"rank": 0}, {"rank": 1}], objects
        dist.destroy_process_group(pair)
    dist.destroy_process_group(g)


def test_sequence_numbers_and_object_collectives_on_subgroups(cpu_ranks):
    cpu_ranks.run(_sequence_numbers)


def _fallback_ops_then_destroy(rank, world, repeats):
    for i in range(repeats):
        g = dist.new_group(list(range(world)), backend="tpcore")
        t = torch.zeros(3)
        dist.scatter(
            t,
            [torch.full((3,), float(r + i)) for r in range(world)] if rank == 0 else None,
            src=0,
            group=g,
        )
        assert t.tolist() == [float(rank + i)] * 3
        dist.gather(
            t, [torch.zeros(3) for _ in range(world)] if rank == 0 else None, dst=0, group=g
        )
        outs = [torch.zeros(2) for _ in range(world)]
        ins = [torch.full((2,), float(rank + d)) for d in range(world)]
        dist.all_to_all(outs, ins, group=g)  # the list form: gloo's
        assert [t.tolist() for t in outs] == [[float(r + rank)] * 2 for r in range(world)]
        assert tpcore.shm.shm_backend_of(g).fallback_ops >= 3
        dist.destroy_process_group(g)  # hung in gloo's destructor, which waited for the GIL


def test_ending_a_group_after_gloo_fallback_operations(cpu_ranks):
    cpu_ranks.run(_fallback_ops_then_destroy, 12, timeout=120)


def _mixed_backends(rank, store_path, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed as dist

    import tpcore  # noqa: F401 - registers the backend

    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, 2),
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    start = time.monotonic()
    try:
        dist.new_group([0, 1], backend="tpcore" if rank == 0 else "gloo")
        results.put((rank, "made", time.monotonic() - start))
    except Exception as e:  # noqa: BLE001 - the error is what the test checks
        results.put((rank, f"{type(e).__name__}: {e}", time.monotonic() - start))
    results.close()
    results.join_thread()
    os._exit(0)


def test_ranks_that_disagree_on_the_backend_get_a_clear_error():
    """The tpcore rank names the gloo rank at once. (The gloo rank waits in gloo's own
    connection code; a launcher ends it when the tpcore rank's process fails.)"""
    ctx = warm_context()
    results = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(prefix="tpcore-mixed-"), "store")
    procs = [
        ctx.Process(target=_mixed_backends, args=(r, store, results), daemon=True) for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        rank, outcome, elapsed = results.get(timeout=120)
        assert rank == 0, (rank, outcome)
        assert outcome.startswith("ValueError") and "rank(s) [1] made it with 'gloo'" in outcome, (
            outcome
        )
        assert elapsed < 10, elapsed
    finally:
        for p in procs:
            p.kill()
            p.join(10)


def _catch(fn) -> str:
    try:
        fn()
        return "no error"
    except Exception as e:  # noqa: BLE001 - the error is what the test checks
        return f"{type(e).__name__}: {e}"


def _misuse(rank, world):
    g = dist.new_group([0, 1], backend="tpcore")  # every rank makes every group, in order
    if rank >= 2:
        dist.barrier()
        dist.new_group([0, 1], backend="tpcore", timeout=timedelta(seconds=1))
        return None
    out = {}
    # One rank's call runs through shared memory, the other's through gloo (a reduce op the
    # shared-memory path lacks): both name the mismatch, and the group stays usable.
    x = torch.ones(4, dtype=torch.int32)
    op = dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.BAND
    out["shm vs gloo"] = _catch(lambda: dist.all_reduce(x, op=op, group=g))
    out["reduce vs all_reduce"] = _catch(
        lambda: dist.reduce(x, dst=0, group=g) if rank == 0 else dist.all_reduce(x, group=g)
    )
    y = torch.ones(3)
    dist.all_reduce(y, group=g)
    out["usable after"] = y.tolist()
    # A receive of another dtype with the same number of bytes
    if rank == 0:
        dist.send(torch.ones(4), dst=1, group=g)
        out["dtype"] = "sent"
    else:
        out["dtype"] = _catch(lambda: dist.recv(torch.zeros(4, dtype=torch.int32), src=0, group=g))
    dist.barrier()
    # A rank arriving after its peer timed out fails too, instead of using what it left.
    short = dist.new_group([0, 1], backend="tpcore", timeout=timedelta(seconds=1))
    if rank == 1:
        time.sleep(2.5)
    out["late"] = _catch(lambda: dist.all_reduce(torch.ones(4), group=short))
    dist.destroy_process_group(short)
    dist.destroy_process_group(g)
    return out


def test_calls_that_do_not_match_fail_on_every_rank(cpu_ranks):
    answers = cpu_ranks.run(_misuse)
    for rank in (0, 1):
        out = answers[rank]
        for case in ("shm vs gloo", "reduce vs all_reduce"):
            assert out[case].startswith("ValueError") and "mismatched collectives" in out[case], (
                rank,
                case,
                out[case],
            )
        assert "through gloo" in out["shm vs gloo"] and "reduce" in out["reduce vs all_reduce"], out
        assert out["usable after"] == [2.0, 2.0, 2.0], out
        assert out["late"].startswith("DistBackendError"), (rank, out["late"])
    assert "Timed out" in answers[0]["late"], answers[0]["late"]
    assert "gave up" in answers[1]["late"], answers[1]["late"]
    assert (
        answers[1]["dtype"].startswith("ValueError")
        and "Float" in answers[1]["dtype"]
        and "Int" in answers[1]["dtype"]
    ), answers[1]


def _group_made_differently(rank, world, store_path, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed as dist

    import tpcore  # noqa: F401 - registers the backend

    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    answers = {}
    # Different rank lists in one new_group call
    start = time.monotonic()
    answers["ranks"] = (
        _catch(
            lambda: dist.new_group(
                [0, 1] if rank == 0 else [0, 1, 2], backend="tpcore", timeout=timedelta(seconds=20)
            )
        ),
        time.monotonic() - start,
    )
    dist.barrier()
    # A rank that reaches new_group after the others gave up (its timeout): it fails at once,
    # not after the store's own timeout (300 s)
    if rank == 1:
        time.sleep(3)
    start = time.monotonic()
    answers["late"] = (
        _catch(lambda: dist.new_group([0, 1], backend="tpcore", timeout=timedelta(seconds=1))),
        time.monotonic() - start,
    )
    results.put((rank, answers))
    results.close()
    results.join_thread()
    os._exit(0)


def test_groups_made_with_other_ranks_or_too_late_are_named():
    store = os.path.join(tempfile.mkdtemp(prefix="tpcore-groups-"), "store")
    answers = run_fresh_processes(_group_made_differently, 3, store, timeout=120)
    for rank in range(3):
        outcome, elapsed = answers[rank]["ranks"]
        assert outcome.startswith("ValueError") and "same ranks" in outcome, (rank, outcome)
        assert elapsed < 10, (rank, elapsed)
    assert "Timed out" in answers[0]["late"][0], answers[0]
    outcome, elapsed = answers[1]["late"]
    assert outcome != "no error" and "gave up" in outcome and elapsed < 10, (outcome, elapsed)
