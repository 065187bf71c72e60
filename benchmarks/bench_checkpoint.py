"""Checkpoint save and load: tpcore's own format against torch's DCP, one run, same model.

    python benchmarks/bench_checkpoint.py [--layers 8 --hidden 1024 --heads 16 --kv-heads 8
                                           --ffn 2816 --vocab 32000] [--tp 2] [--repeats 3]

The model is the 160M Llama-shaped GPT of bench_hf (untied head, GQA), fp32, with
ParallelAdamW state after one step (moments: 12 bytes per parameter in all), at TP=2 on
two gloo ranks of this machine. Each repeat, in the same processes, for each format:
save, then load into a freshly built model and optimizer (other weights), checking that
every loaded tensor equals the saved one. Reported per format: median seconds of save and
of load (the slower rank), and each rank's resident-memory high-water mark above its size
before the step (VmHWM, reset through /proc/self/clear_refs), the larger rank's.

- tpcore: `tpcore.train.save_checkpoint` / `load_checkpoint` (one file per TP rank,
  CRC-32 of every file, memory-mapped loading of only the shared index ranges).
- tpcore_noverify: the same, loaded with `verify=False` (the files' CRC-32 not checked: each
  rank then reads only what it needs; DCP has no checksums, so this is the like-for-like load).
- torch_dist: the same calls with `ckpt_format="torch_dist"` (the trainer's `--ckpt-format
  torch_dist`): DCP's files plus tpcore's metadata, CRC-32 of every file (summed after DCP
  wrote it), RNG files, atomic publish; loaded through DCP after the checksums.
- torch_dist_noverify: the same, loaded with `verify=False`.
- dcp: bare `torch.distributed.checkpoint.save` / `load` of `tpcore.sharded_state_dict`
  and `tpcore.sharded_optimizer_state_dict`, then `tpcore.load_sharded_state_dict` /
  `load_sharded_optimizer_state_dict` (no checksums, no metadata, no RNG).

Both write to --workdir (removed after) and load right after saving, so reads come from the
page cache alike.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import init_ranks, run_on_ranks  # noqa: E402


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) / 1024


def _reset_peak() -> float:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss_mib("VmRSS")


def _worker(rank, world, store, args, results):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import tpcore
    from tpcore.models import GPTConfig, GPTModel
    from tpcore.train import ParallelAdamW, load_checkpoint, save_checkpoint

    torch.set_num_threads(1)
    init_ranks(rank, world, store, "cpu")
    tp_group = tpcore.parallel_state.get_tensor_model_parallel_group()
    dp_group = tpcore.parallel_state.get_data_parallel_group()
    config = GPTConfig(
        vocab_size=args.vocab,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_kv_heads=args.kv_heads,
        ffn_hidden_size=args.ffn,
        max_position_embeddings=64,
        norm="rmsnorm",
        activation="swiglu",
        position_embedding="rotary",
        tie_embeddings=False,
        bias=False,
    )

    def build(seed):
        torch.manual_seed(seed)
        model = GPTModel(config)
        specs = {n: p.shard_spec for n, p in model.named_parameters()}
        opt = ParallelAdamW(
            model,
            is_replicated=lambda n: specs[n].kind == "replicated",
            tp_group=tp_group,
            dp_group=dp_group,
            tp_copies=lambda n: specs[n].copied_elements(),
            lr=1e-4,
            weight_decay=0.1,
        )
        ids = torch.randint(
            0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1)
        )
        model(ids, ids).backward()
        opt.step(1e-4, 1.0)
        return model, opt

    def tensors(model, opt):
        out = {n: p.detach() for n, p in model.named_parameters()}
        out.update(
            {
                f"{n}/{k}": v
                for n, e in opt.state_dict()["params"].items()
                for k, v in e.items()
                if k != "step"
            }
        )
        return out

    model, opt = build(0)
    saved = {k: v.clone() for k, v in tensors(model, opt).items()}
    params = sum(p.numel() for p in model.parameters()) * dist.get_world_size(tp_group)
    formats = ("tpcore", "tpcore_noverify", "torch_dist", "torch_dist_noverify", "dcp")
    times = {f: {"save": [], "load": []} for f in formats}
    peaks = {f: {"save": 0.0, "load": 0.0} for f in times}
    for repeat in range(args.repeats):
        for fmt in times:
            path = os.path.join(args.workdir, f"{fmt}_{repeat}")
            for phase in ("save", "load"):
                if phase == "load":
                    fresh, fresh_opt = build(1)
                dist.barrier()
                base = _reset_peak()
                start = time.perf_counter()
                if fmt != "dcp" and phase == "save":
                    save_checkpoint(
                        path,
                        1,
                        model,
                        opt,
                        consumed_samples=0,
                        tp_group=tp_group,
                        dp_group=dp_group,
                        ckpt_format="torch" if fmt.startswith("tpcore") else "torch_dist",
                    )
                elif fmt != "dcp":
                    verify = not fmt.endswith("_noverify")
                    load_checkpoint(
                        path, fresh, fresh_opt, tp_group=tp_group, load_rng=False, verify=verify
                    )
                elif phase == "save":
                    dcp.save(
                        {
                            "model": tpcore.sharded_state_dict(model),
                            "optim": tpcore.sharded_optimizer_state_dict(model, opt),
                        },
                        checkpoint_id=path,
                    )
                else:
                    state = {
                        "model": tpcore.sharded_state_dict(fresh),
                        "optim": tpcore.sharded_optimizer_state_dict(fresh, fresh_opt),
                    }
                    dcp.load(state, checkpoint_id=path)
                    tpcore.load_sharded_state_dict(fresh, state["model"])
                    tpcore.load_sharded_optimizer_state_dict(fresh, fresh_opt, state["optim"])
                    del state
                elapsed = torch.tensor([time.perf_counter() - start])
                peak = torch.tensor([_rss_mib("VmHWM") - base])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
                times[fmt][phase].append(elapsed.item())
                peaks[fmt][phase] = max(peaks[fmt][phase], peak.item())
                if phase == "load":
                    got = tensors(fresh, fresh_opt)
                    bad = [k for k in saved if not torch.equal(got[k], saved[k])]
                    assert not bad, f"{fmt}: loaded tensors differ from the saved ones: {bad[:5]}"
                    del fresh, fresh_opt, got
            dist.barrier()
            if rank == 0:
                size = sum(
                    os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
                )
                times[fmt].setdefault("bytes", size)
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
    results.put((rank, {"times": times, "peaks": peaks, "params": params}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", default=tempfile.gettempdir())
    args = p.parse_args()
    args.workdir = tempfile.mkdtemp(prefix="bench_checkpoint_", dir=args.workdir)
    try:
        out = run_on_ranks(_worker, args.tp, args)[0]
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
    print(
        f"GPT of {out['params'] / 1e6:.0f}M parameters, fp32 + AdamW state, TP={args.tp} "
        f"(gloo), {args.repeats} repeats; "
        "seconds: median over repeats of the slower rank; peak: larger rank's VmHWM increase\n"
    )
    print(
        "| format | save s | load s | save / tpcore's | load / tpcore's | load / tpcore_noverify's "
        "| save peak MiB | load peak MiB | on disk MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    median = {
        fmt: {k: statistics.median(t[k]) for k in ("save", "load")}
        for fmt, t in out["times"].items()
    }
    for fmt, t in out["times"].items():
        save, load = median[fmt]["save"], median[fmt]["load"]
        print(
            f"| {fmt} | {save:.2f} | {load:.2f} | {save / median['tpcore']['save']:.2f}x | "
            f"{load / median['tpcore']['load']:.2f}x | "
            f"{load / median['tpcore_noverify']['load']:.2f}x | "
            f"{out['peaks'][fmt]['save']:.0f} | {out['peaks'][fmt]['load']:.0f} | "
            f"{t.get('bytes', 0) / 2**20:.0f} |"
        )


if __name__ == "__main__":
    main()
