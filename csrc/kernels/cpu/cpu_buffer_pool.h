// A small, bounded cache of large CPU buffers for tpcore's own [tokens, vocab]-sized
// outputs (the cross-entropy gradient, the fused head's logits chunks).
//
// A fresh multi-MB allocation is mmap'ed by glibc and every page is faulted in on first
// write, which can cost more than the cross-entropy kernels themselves. Buffers freed by
// their tensors return here and are handed out again for the next chunk or step instead.
// The cache holds at most TPCORE_CPU_CACHE_MB (read once; default 256, 0 disables): a
// library should not keep gigabytes between steps, so by default a multi-GB gradient is
// not kept (use inplace_backward=True, a larger TPCORE_CPU_CACHE_MB, or a caching malloc
// such as tcmalloc). Buffers come from torch's CPU allocator, so its settings (a preloaded
// malloc, THP_MEM_ALLOC_ENABLE) apply to them as to any tensor.
#pragma once

#include <ATen/core/Tensor.h>

namespace tpcore {

// An uninitialised contiguous CPU tensor, from the cache when a buffer of the same
// size is free there.
at::Tensor empty_cached_cpu(at::IntArrayRef shape, at::ScalarType dtype);
// Frees every cached buffer; returns how many bytes were released.
int64_t empty_cpu_cache();

}  // namespace tpcore
