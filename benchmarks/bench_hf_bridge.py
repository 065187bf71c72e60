"""The Hugging Face bridge's host memory and the step time of a `--load-hf` model.

    python benchmarks/bench_hf_bridge.py [--layers 8 --hidden 1024 --heads 16 --kv-heads 4
                                          --ffn 2816 --vocab 32000]

A random Llama of that shape is saved with `save_pretrained` (bf16) into a temporary
folder, then, each case in fresh spawned gloo processes (one per rank):
- load: `load_hf_weights` into `build_gpt_stages(config, _init=False)` (bf16) at TP x PP =
  1x1, 2x1, 4x1, 2x2. A rank's peak resident set (VmHWM, reset through /proc/self/clear_refs
  before the case) minus its resident set before it (Python, torch, the process group), the
  model's own shards included; ranks take turns (a barrier between), so the machine's
  memory bounds one rank. Expected: about model / (TP x PP).
- export: `export_hf` of that loaded model at TP 2 and at TP 2 x PP 2 (peak during the
  export only, minus the resident set before it, which holds the model's shards). Expected:
  about the largest tensor.
- convert: `tpcore-convert --to-hf` of a TP 2 checkpoint of it, in one fresh process.
  Expected: about the largest tensor.
- step time (fp32, TP 2): forward + backward + AdamW of the model loaded from the folder
  against `GPTModel(config)` built natively with the same config, in the same processes,
  alternating rounds so that other load on the machine hits both alike.
A tiny model goes through each path first, so library pages touched the first time do not
count. Ratios compare with the model's and the largest tensor's bytes, computed here.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from tpcore.hf.gpt_bridge import config_from_hf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import init_ranks, run_on_ranks  # noqa: E402

import tpcore  # noqa: E402
from tpcore.hf.gpt_bridge import export_hf, load_hf_weights
from tpcore.models import GPTModel  # noqa: E402
from tpcore.pipeline_parallel import build_gpt_stages  # noqa: E402
from tpcore.train import ParallelAdamW, save_checkpoint  # noqa: E402
from tpcore.train.convert import main as convert_main  # noqa: E402


def _mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) / 1024


def _reset_peak() -> float:
    """The resident set now (MiB), after resetting the high-water mark to it."""
    gc.collect()
    before = _mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return before


def llama_config(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=ffn,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )


def save_llama(
    path: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int
) -> None:
    import transformers

    config = llama_config(layers, hidden, heads, kv_heads, ffn, vocab)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)


def _layout(tp: int, pp: int) -> None:
    """TP x PP over the spawned ranks (a collective: every rank, before any turn)."""
    tpcore.destroy_model_parallel()
    tpcore.initialize_model_parallel(tensor_parallel_size=tp, pipeline_parallel_size=pp)


def _load(folder: str, dtype: torch.dtype):
    """This rank's chunks of the folder's model (no collective)."""
    chunks = build_gpt_stages(config_from_hf(folder), _init=False, dtype=dtype)
    load_hf_weights(chunks, folder)
    return chunks


def _memory(rank, world, store, kind, tp, pp, folders, out_root, results):
    torch.set_num_threads(1)
    init_ranks(rank, world, store, "cpu")
    _layout(tp, pp)
    for which in ("tiny", "big"):  # the tiny model first: first-touch library pages
        folder, out = folders[which], os.path.join(out_root, f"{which}-{kind}-tp{tp}-pp{pp}")
        chunks, row = None, None
        for turn in range(world):
            dist.barrier()
            if turn != rank and kind == "load":
                continue
            if kind == "load":
                before = _reset_peak()
                chunks = _load(folder, torch.bfloat16)
                row = (before, _mib("VmHWM"))
            elif turn == 0:  # export is a collective: every rank at once
                chunks = _load(folder, torch.bfloat16)
                before = _reset_peak()
                export_hf(chunks, out)
                row = (before, _mib("VmHWM"))
                if which == "big" and tp == 2 and pp == 1:  # the checkpoint the convert case reads
                    state = tpcore.parallel_state
                    save_checkpoint(
                        os.path.join(out_root, "ckpt"),
                        1,
                        chunks[0],
                        None,
                        consumed_samples=0,
                        tp_group=state.get_tensor_model_parallel_group(),
                        dp_group=state.get_data_parallel_group(),
                    )
        del chunks
    dist.barrier()
    dist.destroy_process_group()
    results.put((rank, row))


def _convert(rank, world, store, ckpt, out_root, results):
    torch.set_num_threads(1)
    rows = []
    for which in ("tiny", "big"):
        src = ckpt[which]
        before = _reset_peak()
        assert (
            convert_main(["--load", src, "--to-hf", os.path.join(out_root, f"converted-{which}")])
            == 0
        )
        rows.append((before, _mib("VmHWM")))
    results.put((rank, rows[-1]))


def _step_time(rank, world, store, folder, rounds, steps, seq, results):
    torch.set_num_threads(1)
    init_ranks(rank, world, store, "cpu")
    group = tpcore.parallel_state.get_tensor_model_parallel_group()
    config = config_from_hf(folder)
    torch.manual_seed(0)
    models = {
        "--load-hf": GPTModel(config, _init=False, dtype=torch.float32),
        "native": GPTModel(config, dtype=torch.float32),
    }
    load_hf_weights(models["--load-hf"], folder)
    opts = {
        k: ParallelAdamW(
            m,
            is_replicated=lambda n: False,
            tp_group=group,
            dp_group=tpcore.parallel_state.get_data_parallel_group(),
            lr=1e-5,
            weight_decay=0.0,
        )
        for k, m in models.items()
    }
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=g)
    times = {k: [] for k in models}
    for r in range(rounds + 1):  # round 0 warms up
        for name in list(models) if r % 2 else list(models)[::-1]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                models[name](ids, ids.roll(-1, 1)).backward()
                opts[name].step(1e-5, 0.0)
            dist.barrier()
            if r:
                times[name].append((time.perf_counter() - start) / steps)
    dist.destroy_process_group()
    results.put((rank, {k: sorted(v)[len(v) // 2] for k, v in times.items()}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument(
        "--seq", type=int, default=128, help="tokens per step (batch 1) for the step time"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--workdir", default=tempfile.gettempdir())
    args = p.parse_args()
    # checked here, not by a rank after the model was written: the cases load at TP 4 and at
    # PP 2
    try:
        config_from_hf(
            llama_config(args.layers, args.hidden, args.heads, args.kv_heads, args.ffn, args.vocab)
        ).check_tp(4)
        if args.layers < 2:
            raise ValueError(f"--layers {args.layers}: the PP 2 cases need 2 or more")
    except ValueError as e:
        p.error(str(e))
    root = tempfile.mkdtemp(prefix="tpcore-bench-hf-", dir=args.workdir)
    try:
        folders = {"big": os.path.join(root, "big"), "tiny": os.path.join(root, "tiny")}
        save_llama(
            folders["big"],
            args.layers,
            args.hidden,
            args.heads,
            args.kv_heads,
            args.ffn,
            args.vocab,
        )
        save_llama(folders["tiny"], 2, 64, 4, 2, 96, 256)
        import safetensors.torch as st

        tensors = st.load_file(os.path.join(folders["big"], "model.safetensors"))
        model_mib = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
        largest_key = max(tensors.items(), key=lambda item: item[1].numel())[0]
        largest_mib = tensors[largest_key].numel() * tensors[largest_key].element_size() / 2**20
        del tensors
        print(
            f"Llama {args.layers} layers, hidden {args.hidden}, heads {args.heads} / kv "
            f"{args.kv_heads}, ffn {args.ffn}, vocab {args.vocab}, "
            f"bf16: model {model_mib:.1f} MiB, largest tensor {largest_key} "
            f"{largest_mib:.1f} MiB; torch {torch.__version__}, "
            f"load average {os.getloadavg()[0]:.2f}"
        )
        header = (
            f"{'case':<30} {'rank':>4} {'before MiB':>10} {'peak MiB':>9} {'increase':>9} "
            f"{'expected':>9} {'ratio':>6}"
        )
        print("\nPeak host memory per rank (increase = peak - resident set before the case)")
        print(header)
        for kind, layouts in (
            ("load", [(1, 1), (2, 1), (4, 1), (2, 2)]),
            ("export", [(2, 1), (2, 2)]),
        ):
            for tp, pp in layouts:
                out = os.path.join(root, "out")
                os.makedirs(out, exist_ok=True)
                rows = run_on_ranks(_memory, tp * pp, kind, tp, pp, folders, out)
                expected = model_mib / (tp * pp) if kind == "load" else largest_mib
                for rank, (before, peak) in enumerate(rows):
                    print(
                        f"{kind + f' TP={tp} PP={pp}':<30} {rank:>4} {before:>10.1f} "
                        f"{peak:>9.1f} {peak - before:>9.1f} {expected:>9.1f} "
                        f"{(peak - before) / expected:>6.2f}"
                    )
                if kind == "export":  # keep the checkpoint for the convert case, drop the rest
                    for name in os.listdir(out):
                        if name != "ckpt":
                            shutil.rmtree(os.path.join(out, name))
        out = os.path.join(root, "out")
        tiny_ckpt = os.path.join(root, "tiny-ckpt")
        run_on_ranks(_save_tiny, 2, folders["tiny"], tiny_ckpt)
        ((before, peak),) = run_on_ranks(
            _convert, 1, {"tiny": tiny_ckpt, "big": os.path.join(out, "ckpt")}, out
        )
        print(
            f"{'tpcore-convert --to-hf (TP 2 ckpt)':<30} {0:>4} {before:>10.1f} "
            f"{peak:>9.1f} {peak - before:>9.1f} {largest_mib:>9.1f} "
            f"{(peak - before) / largest_mib:>6.2f}"
        )
        shutil.rmtree(out)
        print(
            f"\nGPT step time, fp32, TP 2, batch 1 x {args.seq} tokens, median of "
            f"{args.rounds} rounds x {args.steps} steps "
            f"(load average before {os.getloadavg()[0]:.2f})"
        )
        times = run_on_ranks(_step_time, 2, folders["big"], args.rounds, args.steps, args.seq)[0]
        print(
            f"  --load-hf model {times['--load-hf'] * 1e3:.0f} ms/step, native model "
            f"{times['native'] * 1e3:.0f} ms/step, "
            f"ratio {times['--load-hf'] / times['native']:.3f} (load average after "
            f"{os.getloadavg()[0]:.2f})"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _save_tiny(rank, world, store, folder, ckpt, results):
    init_ranks(rank, world, store, "cpu")
    chunks = _load(folder, torch.bfloat16)
    state = tpcore.parallel_state
    save_checkpoint(
        ckpt,
        1,
        chunks[0],
        None,
        consumed_samples=0,
        tp_group=state.get_tensor_model_parallel_group(),
        dp_group=state.get_data_parallel_group(),
    )
    dist.destroy_process_group()
    results.put((rank, None))


if __name__ == "__main__":
    main()
