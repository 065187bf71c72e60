"""Generate with a Hugging Face model split tensor-parallel by tpcore.hf.

Under torchrun (every rank loads only its slices of the saved model):

    torchrun --standalone --nproc_per_node 2 examples/hf_generate.py --tensor-parallel-size 2

Without torchrun (the launcher spawns the two workers itself; works from a notebook too):

    python examples/hf_generate.py --launcher --tensor-parallel-size 2

`--model PATH` takes a `save_pretrained` folder (safetensors; with its tokenizer, `--prompt`
is text). Without it a small Llama with random weights is built from a config and saved
first (no download), so the ids are meaningless but checked against plain transformers
(`--check`, on by default for the demo model).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist

import tpcore


def build_demo_model(path: str) -> str:
    """A 4-layer Llama (hidden 256, GQA 8/4 heads, vocab 1000) with random weights, saved to
    `path`."""
    import transformers

    if not os.path.isfile(os.path.join(path, "config.json")):
        config = transformers.LlamaConfig(
            vocab_size=1000,
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=512,
            initializer_range=0.2,
            bos_token_id=None,
            eos_token_id=None,
        )
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def prompt_ids(path: str, args) -> tuple[torch.Tensor, object]:
    """The prompt as ids `[1, t]`, and the tokenizer when the folder has one."""
    tokenizer = None
    if any(
        os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        return tokenizer(args.prompt, return_tensors="pt").input_ids, tokenizer
    return torch.tensor([[int(t) for t in args.prompt_ids.split(",")]]), tokenizer


def sampling_kwargs(args) -> dict:
    return dict(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        top_k=args.top_k,
        top_p=args.top_p,
        temperature=args.temperature,
        seed=args.seed,
    )


def show(tokens: torch.Tensor, tokenizer, prompt_len: int) -> None:
    print("generated ids:", tokens[0, prompt_len:].tolist())
    if tokenizer is not None:
        print("text:", tokenizer.decode(tokens[0], skip_special_tokens=True))


def check_against_transformers(path: str, ids: torch.Tensor, tokens: torch.Tensor, args) -> None:
    """Greedy ids must equal plain transformers' on the dense model."""
    import transformers

    dense = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    want = dense.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
    same = torch.equal(want, tokens)
    print(f"same ids as plain transformers (dense, greedy): {'yes' if same else 'NO'}")
    if not same:
        raise SystemExit(1)


def run_torchrun(path: str | None, args) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if path is None:  # rank 0 saves the demo model, the others wait for it
        if dist.get_rank() == 0:
            build_demo_model(args.demo_dir)
        dist.barrier()
        path = args.demo_dir
    ok = False
    try:
        tpcore.initialize_model_parallel(tensor_parallel_size=args.tensor_parallel_size)
        model = tpcore.hf.from_pretrained(path, dtype=getattr(torch, args.dtype))
        ids, tokenizer = prompt_ids(path, args)
        tokens = tpcore.hf.generate(model, ids, **sampling_kwargs(args)).cpu()
        if dist.get_rank() == 0:
            show(tokens, tokenizer, ids.shape[1])
            if args.check and not args.do_sample:
                check_against_transformers(path, ids, tokens, args)
        ok = True
    finally:
        tpcore.shutdown(barrier=ok)


def run_launcher(path: str, args) -> None:
    ids, tokenizer = prompt_ids(path, args)
    with tpcore.hf.launch(
        path, args.tensor_parallel_size, dtype=getattr(torch, args.dtype)
    ) as model:
        peaks = [(s["peak_rss_kib"] - s["rss_before_kib"]) / 1024 for s in model.load_stats]
        print("peak MiB per rank while loading:", [round(p, 1) for p in peaks])
        tokens = model.generate(ids, **sampling_kwargs(args))
    show(tokens, tokenizer, ids.shape[1])
    if args.check and not args.do_sample:
        check_against_transformers(path, ids, tokens, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", help="a save_pretrained folder; default: a demo Llama built from a config"
    )
    parser.add_argument(
        "--demo-dir", default=os.path.join(tempfile.gettempdir(), "tpcore-hf-demo-llama")
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument(
        "--launcher",
        action="store_true",
        help="spawn the workers here instead of running under torchrun",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--prompt",
        default="The tensor-parallel model says",
        help="text (needs a tokenizer in the folder)",
    )
    parser.add_argument(
        "--prompt-ids",
        default="1,17,42,99,7",
        help="comma-separated ids when there is no tokenizer",
    )
    parser.add_argument("--max-new-tokens", type=int, default=30)
    parser.add_argument("--do-sample", action="store_true")
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compare greedy ids with plain transformers (default: on for the demo model)",
    )
    args = parser.parse_args()
    args.check = args.model is None if args.check is None else args.check
    if args.launcher:
        run_launcher(args.model or build_demo_model(args.demo_dir), args)
    elif "WORLD_SIZE" in os.environ:
        run_torchrun(args.model, args)
    else:
        parser.error("run under torchrun, or pass --launcher")


if __name__ == "__main__":
    main()
