"""tpcore's CPU buffer cache keeps at most TPCORE_CPU_CACHE_MB between steps."""

from __future__ import annotations

import os

import programs

# Run in a fresh process: the limit is read once, when the cache is first used.
_SCRIPT = (
    r"""
import os, tempfile
import torch, torch.distributed as dist, torch.nn.functional as F
import tpcore

MiB = 1 << 20

def step(tokens, vocab):
    '''One forward+backward whose fp32 gradient is tokens * vocab * 4 bytes, checked
    against F.cross_entropy; the gradient is freed on return. Returns its address.'''
    g = torch.Generator().manual_seed(tokens + vocab)
    logits = torch.randn(tokens, vocab, generator=g).requires_grad_(True)
    target = torch.randint(0, vocab, (tokens,), generator=g)
    tpcore.vocab_parallel_cross_entropy(logits, target).backward()
    ref = logits.detach().clone().requires_grad_(True)
    F.cross_entropy(ref, target).backward()
    torch.testing.assert_close(logits.grad, ref.grad, rtol=1e-5, """
    r"""atol=1e-5 * ref.grad.abs().max().item())
    return logits.grad.data_ptr()

with tempfile.TemporaryDirectory() as tmp:
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), """
    r"""rank=0, world_size=1)
    tpcore.initialize_model_parallel(1)
    assert os.environ["TPCORE_CPU_CACHE_MB"] == "3"
    first = step(256, 1024)  # 1 MiB: kept, and handed out again
    assert step(256, 1024) == first
    assert tpcore.empty_cpu_cache() == MiB
    step(256, 1024)
    step(512, 1024)  # 1 + 2 MiB: both fit
    assert tpcore.empty_cpu_cache() == 3 * MiB
    step(256, 1024)
    step(512, 1024)
    step(384, 1024)  # 1.5 MiB: the oldest (1 MiB, then 2 MiB) make room for it
    assert tpcore.empty_cpu_cache() == 3 * MiB // 2
    step(1024, 1024)  # 4 MiB, over the limit: released at once
    assert tpcore.empty_cpu_cache() == 0
    dist.destroy_process_group()
print("cache ok")
"""
)


def test_cache_is_bounded_and_evicts_the_oldest():
    env = {**os.environ, "TPCORE_CPU_CACHE_MB": "3"}
    proc = programs.start(["-c", _SCRIPT], env=env)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0 and "cache ok" in out, out
