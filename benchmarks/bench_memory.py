"""Peak host memory per rank: building a large GPT, and resharding its checkpoint.

    python benchmarks/bench_memory.py [--layers 22 --hidden 2048 --heads 16 --vocab 50257]
                                      [--workdir /tmp]
    python benchmarks/bench_memory.py --skip-build --skip-baseline
                                      --remap-mib 1048576   # one mapping per file

Every case runs in fresh spawned gloo processes (one per rank), so no peak leaks from one
case into the next. Inside a case the ranks take turns (a barrier between turns): the
machine's memory then bounds one rank, not the sum, while each process's own peak is
unchanged. A rank's peak is its resident-set high-water mark (VmHWM, reset through
/proc/self/clear_refs just before the case; memory-mapped file pages it touched count
too); "increase" is that peak minus the rank's resident set before the case (Python,
torch and the process group). Ratios compare increases with the TP=1 case of the same
kind, against the ideal 1/TP.

Two code paths, measured in the same run:
- tpcore: `GPTModel(config)` (each rank draws only its shards) and `load_checkpoint`
  (memory-mapped saved shards, only the shared index ranges copied).
- full-model baseline: what tpcore did before, reproduced step by step here: the shard
  allocated in fp32 and cast, then a whole `ReferenceGPT` drawn and sliced on every rank;
  every saved shard `torch.load`ed whole, merged into dense tensors and cut again.

Checkpoints hold the model weights only (bf16): AdamW state for this size (12 bytes per
parameter) would not fit this machine's disk and memory budget; it is resharded by the
same code (tests/checkpoint/test_checkpoint_reshard.py). They are written under --workdir
and removed.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import init_ranks, run_on_ranks  # noqa: E402

import tpcore  # noqa: E402
from tpcore.checkpoint import shard_reading
from tpcore.checkpoint.load import read_metadata  # noqa: E402
from tpcore.models import GPTConfig, GPTModel, ReferenceGPT  # noqa: E402
from tpcore.tensor_parallel.shard_spec import merge, shard  # noqa: E402
from tpcore.train import load_checkpoint, save_checkpoint

DTYPE = torch.bfloat16
TINY = GPTConfig(
    vocab_size=300, num_layers=1, hidden_size=64, num_attention_heads=4, max_position_embeddings=32
)


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) / 1024


def _config(args) -> GPTConfig:
    return GPTConfig(
        vocab_size=args.vocab,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        max_position_embeddings=args.seq,
    )


def _build_baseline(config: GPTConfig, group) -> GPTModel:
    """The old GPTModel(config, dtype=bf16): shard allocated in fp32 and cast, then the whole
    ReferenceGPT drawn on this rank and sliced."""
    model = GPTModel(config, group=group, _init=False).to(DTYPE)
    model.load_dense_state_dict(ReferenceGPT(config, dtype=DTYPE).state_dict())
    return model


def _load_baseline(directory: str, model: GPTModel, rank: int, tp: int) -> None:
    """The old load_checkpoint (weights): every saved shard loaded whole, merged, cut again."""
    saved_tp = read_metadata(directory)["tensor_parallel_size"]
    files = [os.path.join(directory, f"model_tp{r:02d}_pp00.pt") for r in range(saved_tp)]
    if saved_tp == tp:
        state = torch.load(files[rank], map_location="cpu", weights_only=True)["model"]
    else:
        states = [torch.load(f, map_location="cpu", weights_only=True)["model"] for f in files]
        specs = {name: p.shard_spec for name, p in model.named_parameters()}
        state = {}
        for name in states[0]:
            spec = specs[name]
            state[name] = shard(
                merge([s[name] for s in states], spec.at(saved_tp, 0)), spec
            ).contiguous()
    model.load_state_dict(state)


def _case(
    config: GPTConfig,
    kind: str,
    path: str,
    directory: str | None,
    rank: int,
    tp: int,
    group,
    alone=None,
) -> None:
    torch.manual_seed(0)
    if kind == "build":
        model = (
            GPTModel(config, group=group, dtype=DTYPE)
            if path == "tpcore"
            else _build_baseline(config, group)
        )
    else:
        model = GPTModel(config, group=group, dtype=DTYPE, _init=False)
        if path == "tpcore":
            load_checkpoint(
                directory, model, tp_group=group, load_rng=False, load_group=alone
            )  # ranks load in turns
        else:
            _load_baseline(directory, model, rank, tp)
    assert all(p.dtype == DTYPE for p in model.parameters())


def _measure(rank, world, store, config, kind, path, directory, warmup, remap_mib, results):
    torch.set_num_threads(2)
    if remap_mib is not None:
        shard_reading.MappedFile.REMAP_BYTES = remap_mib << 20
    init_ranks(rank, world, store, "cpu")
    group = tpcore.parallel_state.get_tensor_model_parallel_group()
    alone = [dist.new_group([r]) for r in range(world)][rank]  # each rank loads on its own
    # The same code path on a tiny model first: pages of torch's libraries that the path
    # touches the first time would otherwise count in the measured peak.
    _case(TINY, kind, path, warmup, rank, world, group, alone)
    out = None
    for turn in range(world):
        if turn == rank:
            gc.collect()
            before = _status_mib("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current resident set
            _case(config, kind, path, directory, rank, world, group, alone)
            peak = _status_mib("VmHWM")
            out = (before, peak)
        dist.barrier()
    dist.destroy_process_group()
    results.put((rank, out))


def _save(rank, world, store, config, save_dir, results):
    torch.set_num_threads(2)
    init_ranks(rank, world, store, "cpu")
    state = tpcore.parallel_state
    torch.manual_seed(0)
    model = GPTModel(config, dtype=DTYPE)
    save_checkpoint(
        save_dir,
        1,
        model,
        None,
        consumed_samples=0,
        tp_group=state.get_tensor_model_parallel_group(),
        dp_group=state.get_data_parallel_group(),
    )
    dist.destroy_process_group()
    results.put((rank, None))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument(
        "--workdir",
        default=tempfile.gettempdir(),
        help="where the checkpoints are written (and removed)",
    )
    p.add_argument("--skip-baseline", action="store_true", help="measure tpcore's path only")
    p.add_argument("--skip-build", action="store_true", help="measure checkpoint loading only")
    p.add_argument(
        "--remap-mib",
        type=int,
        default=None,
        help=(
            "map a saved file afresh after this many MiB read (default: the library's 64; "
            "huge: one mapping per file)"
        ),
    )
    args = p.parse_args()
    config = _config(args)
    params = sum(p.numel() for p in ReferenceGPT(config, device="meta").parameters())
    print(
        f"GPT {params / 1e9:.3f} B parameters ({args.layers} layers, hidden {args.hidden}, "
        f"vocab {args.vocab}), bf16: "
        f"{params * 2 / 2**20:.0f} MiB of weights; torch {torch.__version__}, {os.cpu_count()} CPUs"
    )
    paths = ["tpcore"] + ([] if args.skip_baseline else ["full-model baseline"])
    header = (
        f"{'case':<34} {'rank':>4} {'before MiB':>10} {'peak MiB':>9} {'increase':>9} "
        f"{'ratio':>6} {'ideal':>6}"
    )
    root = tempfile.mkdtemp(prefix="tpcore-bench-memory-", dir=args.workdir)
    try:
        reference = {}
        if not args.skip_build:
            print(
                "\n(a) building the model (GPTModel(config, dtype=bf16) after torch.manual_seed(0))"
            )
            print(header)
            for path in paths:
                for tp in (1, 4):
                    rows = run_on_ranks(_measure, tp, config, "build", path, None, None, None)
                    _report(f"{path}: build TP={tp}", rows, tp, reference, "build")
        save = {tp: os.path.join(root, f"tp{tp}") for tp in (1, 4)}
        tiny = {tp: os.path.join(root, f"tiny{tp}") for tp in (1, 4)}
        for tp in (1, 4):
            run_on_ranks(_save, tp, config, save[tp])
            run_on_ranks(_save, tp, TINY, tiny[tp])
        print("\n(b) loading its checkpoint (weights) at another TP size (same size for reference)")
        print(header)
        for path in paths:
            for saved_tp, tp in ((1, 1), (1, 4), (4, 4), (4, 1), (4, 2)):
                directory = os.path.join(save[saved_tp], "iter_0000001")
                warmup = os.path.join(tiny[saved_tp], "iter_0000001")
                rows = run_on_ranks(
                    _measure, tp, config, "load", path, directory, warmup, args.remap_mib
                )
                _report(f"{path}: TP={saved_tp} -> TP={tp}", rows, tp, reference, "load")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _report(
    name: str, rows: list[tuple[float, float]], tp: int, reference: dict, kind: str
) -> None:
    for rank, (before, peak) in enumerate(rows):
        increase = peak - before
        reference.setdefault(kind, increase)  # the first case of each kind is tpcore at TP=1
        ratio = increase / reference[kind]
        print(
            f"{name:<34} {rank:>4} {before:>10.0f} {peak:>9.0f} {increase:>9.0f} "
            f"{ratio:>6.2f} {1 / tp:>6.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
