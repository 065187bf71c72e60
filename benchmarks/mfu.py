"""Model FLOPs utilisation for the GPT benchmark: the model's training FLOPs per step
from its config, and the two ceilings to divide by (a large matmul measured on the same
device in the same run, and a datasheet peak)."""

from __future__ import annotations

import statistics
import time

import torch

from tpcore.models import GPTConfig

# Dense (no sparsity) bf16/fp16 tensor-core peak of the SXM parts, TFLOP/s. The PCIe and
# NVL H100s are lower (756 / 835): pass --peak-tflops there.
_TENSOR_CORE_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4}


def matmul_parameters(c: GPTConfig) -> int:
    """Weights each token is multiplied by: every block's qkv, proj, fc1 and fc2, plus the
    LM head (H x vocab, counted whether or not it is tied to the embedding: the lookup is
    no matmul, the head is). Biases, norms and the position table are not matmuls."""
    qkv = c.hidden_size * (c.num_attention_heads + 2 * c.num_kv_heads) * c.head_dim
    proj = c.num_attention_heads * c.head_dim * c.hidden_size
    fc1 = c.hidden_size * c.ffn_hidden_size * (2 if c.gated_mlp else 1)
    fc2 = c.ffn_hidden_size * c.hidden_size
    return c.num_layers * (qkv + proj + fc1 + fc2) + c.hidden_size * c.vocab_size


def training_flops(c: GPTConfig, batch: int, seq: int) -> int:
    """Model FLOPs of one training step (forward + backward), the usual MFU convention
    (Narayanan et al. 2021, eq. 3; PaLM, appendix B):

        6 * matmul_parameters * tokens  +  12 * layers * hidden * seq * tokens

    6 = 2 FLOPs per multiply-add x (forward + 2 backward GEMMs). The second term is the
    attention scores Q K^T and the context P V: 2 x 2 x seq x hidden per token and layer
    forward, x3 with backward, over the full seq x seq square (causal kernels skip about
    half of it; by convention it is counted whole). The vocabulary is the real one (the
    padding columns GPTModel computes are no useful work). Recomputation, element-wise ops,
    softmax and the loss are not counted: this is model FLOPs, not hardware FLOPs.
    """
    tokens = batch * seq
    # The attention term's "hidden" is the width of the heads (heads x head dim; H unless
    # kv_channels says otherwise).
    return (
        6 * matmul_parameters(c) * tokens
        + 12 * c.num_layers * c.num_attention_heads * c.head_dim * seq * tokens
    )


def _median_seconds(fn, device: torch.device, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)  # ms -> s
    else:
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measured_matmul_flops(device: str | torch.device, dtype: torch.dtype) -> tuple[int, float]:
    """(n, FLOP/s) of the median n x n x n matmul in `dtype` on `device`: what this device
    reaches on the friendliest GEMM there is, under this process's threads and clocks.
    n = 8192 on CUDA (~1.1 TFLOP: ~1 ms on an H100 in bf16), 2048 on CPU (~17 GFLOP:
    a fraction of a second on a few cores)."""
    device = torch.device(device)
    n, warmup, reps = (8192, 5, 20) if device.type == "cuda" else (2048, 1, 5)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = _median_seconds(lambda: torch.mm(a, b, out=out), device, warmup, reps)
    return n, 2 * n**3 / seconds


def datasheet_peak_tflops(device_name: str, dtype: torch.dtype) -> float | None:
    """Default datasheet peak per device, or None: only known GPUs, and only in a dtype
    their tensor-core figure is for (fp32 runs without TF32 get a small fraction of it)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    return next(
        (peak for key, peak in _TENSOR_CORE_PEAK_TFLOPS.items() if key in device_name), None
    )
