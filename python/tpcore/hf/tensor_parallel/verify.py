"""`verify`: run a model dense and tensor-parallel on the same prompts and compare logits,
every layer's hidden state and greedy generation; say where they first diverge.

Without a distributed job it starts the workers itself (`launch`); under torchrun (groups
set up with `tpcore.initialize_model_parallel`) every rank loads both models. Console
script: `tpcore-hf-verify PATH --tensor-parallel-size 2`.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import transformers

__all__ = ["Comparison", "ModelLoadError", "VerifyReport", "verify", "collect", "main"]

# transformers renamed from_pretrained's torch_dtype to dtype in 4.56.
_DTYPE_KWARG = (
    "dtype"
    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (4, 56)
    else "torch_dtype"
)


class ModelLoadError(ValueError):
    """The dense model could not be loaded from the folder given (before any comparison)."""


RTOL = {torch.float32: 1e-4, torch.float64: 1e-10, torch.float16: 1e-2, torch.bfloat16: 5e-2}
"""Default tolerances, relative to the largest magnitude of the dense tensor."""


@dataclass
class Comparison:
    """One compared output: `max_abs_diff` against `tolerance` (rtol x max |dense|)."""

    name: str
    max_abs_diff: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance


@dataclass
class VerifyReport:
    """The result of `verify`; `ok` when every comparison passed."""

    tensor_parallel_size: int
    comparisons: list[Comparison] = field(default_factory=list)
    greedy: dict[str, bool] = field(default_factory=dict)
    """Whether the parallel model's greedy ids equal the dense model's, by generator."""

    @property
    def first_divergence(self) -> str | None:
        """The first output (embeddings, then layers in order, then logits) that diverges."""
        return next((c.name for c in self.comparisons if not c.ok), None)

    @property
    def ok(self) -> bool:
        return self.first_divergence is None and all(self.greedy.values())

    def __str__(self) -> str:
        lines = [f"tpcore.hf.verify: tensor_parallel_size={self.tensor_parallel_size}"]
        for c in self.comparisons:
            lines.append(
                f"  {c.name:<28} max |diff| {c.max_abs_diff:.3e}  (tolerance {c.tolerance:.3e})  "
                f"{'ok' if c.ok else 'DIVERGES'}"
            )
        for name, same in self.greedy.items():
            lines.append(f"  greedy ids ({name}): {'identical' if same else 'DIFFER'}")
        first = self.first_divergence
        lines.append(
            "  OK: the parallel model matches the dense one"
            if self.ok
            else f"  FAILED: first divergence at {first}"
            if first
            else "  FAILED: greedy generation differs"
        )
        return "\n".join(lines)


def _eos(model):
    config = getattr(model, "generation_config", None)
    return (
        None if config is None else config.eos_token_id,
        None if config is None else config.pad_token_id,
    )


def collect(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int
) -> dict:
    """The outputs `verify` compares, as float CPU tensors: hidden states, logits / pooled
    output, and greedy ids (HF's `generate`, and `tpcore.hf.generate` on a parallel model)."""
    from .lm_head import VocabParallelLMHead

    parallel = any(isinstance(m, VocabParallelLMHead) for m in model.modules())
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    attention_mask = None if attention_mask is None else attention_mask.to(device)
    with torch.no_grad():
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            output_hidden_states=True,
            use_cache=False,
        )
    result = {f"hidden_states[{i}]": h.float().cpu() for i, h in enumerate(out.hidden_states)}
    for name in ("logits", "prediction_logits", "pooler_output"):
        if getattr(out, name, None) is not None:
            result[name] = getattr(out, name).float().cpu()
    if max_new_tokens and getattr(model, "can_generate", lambda: False)():
        eos, pad = _eos(model)
        from transformers import GenerationConfig

        # Plain greedy, whatever the checkpoint's generation_config.json adds (a repetition
        # penalty, suppressed tokens...): tpcore.hf.generate applies none of it. Swapped in
        # as the model's own config, since generate() fills a passed config's unset fields
        # from the model's.
        saved_config = model.generation_config
        model.generation_config = GenerationConfig(
            eos_token_id=eos, pad_token_id=pad if pad is not None else eos
        )
        try:
            result["greedy:model.generate"] = model.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
            ).cpu()
        finally:
            model.generation_config = saved_config
        if parallel:
            from .generate import generate

            result["greedy:tpcore.hf.generate"] = generate(
                model,
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos,
                pad_token_id=pad,
            ).cpu()
    return result


def _compare(
    dense: dict, parallel: dict, tp: int, rtol: float, mask: torch.Tensor | None
) -> VerifyReport:
    report = VerifyReport(tp)
    for name, ref in dense.items():
        if name.startswith("greedy:"):
            continue
        got = parallel[name]
        # encoders: only the real (unpadded) positions count
        if mask is not None and ref.dim() == 3:
            keep = mask.bool().unsqueeze(-1).expand_as(ref)
            ref, got = ref[keep], got[keep]
        diff = (got - ref).abs().max().item() if ref.numel() else 0.0
        label = name.replace("hidden_states[0]", "hidden_states[0] (embeddings)")
        report.comparisons.append(
            Comparison(
                label, diff, rtol * max(ref.abs().max().item() if ref.numel() else 0.0, 1e-6)
            )
        )
    for name, ids in parallel.items():
        if name.startswith("greedy:"):
            report.greedy[name[len("greedy:") :]] = torch.equal(ids, dense["greedy:model.generate"])
    return report


def _inputs(vocab: int, batch: int, seq_len: int, encoder: bool, seed: int):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    mask = None
    if encoder and batch > 1:  # a padded batch: the last row's tail is padding
        mask = torch.ones_like(input_ids)
        mask[-1, seq_len // 2 :] = 0
    return input_ids, mask


def verify(
    path_or_model,
    tensor_parallel_size: int,
    *,
    dtype: torch.dtype = torch.float32,
    input_ids: torch.Tensor | None = None,
    batch: int = 2,
    seq_len: int = 16,
    max_new_tokens: int = 8,
    rtol: float | None = None,
    seed: int = 0,
    model_class=None,
    print_report: bool = True,
) -> VerifyReport:
    """Compare `path_or_model` (a save_pretrained folder or a dense transformers model) with
    its tensor-parallel version at `tensor_parallel_size`, on random prompts (or `input_ids`).
    Returns a `VerifyReport` (printed by rank 0 unless `print_report=False`)."""
    from .launcher import launch
    from .parallelize import from_pretrained, parallelize

    rtol = RTOL[dtype] if rtol is None else rtol
    if isinstance(path_or_model, (str, os.PathLike)):
        path = str(path_or_model)
        try:
            config = transformers.AutoConfig.from_pretrained(path)
            cls = (
                getattr(transformers, model_class) if isinstance(model_class, str) else model_class
            )
            cls = cls or getattr(transformers, config.architectures[0])
            dense = cls.from_pretrained(path, **{_DTYPE_KWARG: dtype}).eval()
        except torch.OutOfMemoryError:  # the machine's limit, not the folder's fault
            raise
        except (OSError, ValueError, RuntimeError, KeyError, AttributeError, TypeError) as e:
            # A folder transformers cannot load (a config that contradicts the weights, say):
            # nothing to compare yet, so no parallel model is built.
            raise ModelLoadError(
                f"tpcore-hf-verify: transformers cannot load the dense model from {path}: "
                f"{type(e).__name__}: {e}"
            ) from e
    else:
        path, dense = None, copy.deepcopy(path_or_model).to(dtype).eval()
    encoder = not getattr(dense, "can_generate", lambda: False)()
    if input_ids is None:
        input_ids, mask = _inputs(dense.config.vocab_size, batch, seq_len, encoder, seed)
    else:
        mask = None
    expected = collect(dense, input_ids, mask, max_new_tokens)
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:  # under torchrun: every rank builds its part
        parallel = (
            from_pretrained(
                path,
                dtype=dtype,
                tensor_parallel_size=tensor_parallel_size,
                model_class=model_class,
            )
            if path
            else parallelize(copy.deepcopy(dense))
        )
        got = collect(parallel, input_ids, mask, max_new_tokens)
    else:
        with tempfile.TemporaryDirectory(prefix="tpcore-verify-") as tmp:
            if path is None:
                dense.save_pretrained(tmp)
            with launch(
                path or tmp, tensor_parallel_size, dtype=dtype, model_class=model_class
            ) as handle:
                got = handle.run(collect, input_ids, mask, max_new_tokens)
    report = _compare(expected, got, tensor_parallel_size, rtol, mask)
    if print_report and (not distributed or dist.get_rank() == 0):
        print(report, flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    """tpcore-hf-verify: exit status 0 when the parallel model matches the dense one, 1 when
    it does not, 2 when the folder cannot be loaded as a transformers model."""
    parser = argparse.ArgumentParser(prog="tpcore-hf-verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="a save_pretrained folder (safetensors)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument(
        "--rtol",
        type=float,
        default=None,
        help="tolerance relative to max |dense| (default per dtype)",
    )
    parser.add_argument(
        "--model-class",
        default=None,
        help="a transformers class name (default: the config's architecture)",
    )
    args = parser.parse_args(argv)
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:  # launched by torchrun
        import tpcore

        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        tpcore.initialize_model_parallel(tensor_parallel_size=args.tensor_parallel_size)
    try:
        report = verify(
            args.path,
            args.tensor_parallel_size,
            dtype=getattr(torch, args.dtype),
            batch=args.batch,
            seq_len=args.seq_len,
            max_new_tokens=args.max_new_tokens,
            rtol=args.rtol,
            model_class=args.model_class,
        )
    except ModelLoadError as e:  # the user's folder, not a bug: one line, no traceback
        print(e, file=sys.stderr)
        return 2
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
