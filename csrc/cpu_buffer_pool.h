// A small cache of large CPU buffers for tpcore's own [tokens, vocab]-sized outputs.
//
// A fresh multi-hundred-MB allocation is mmap'ed and every page is faulted in on first
// write, which costs more than the cross-entropy kernels themselves on small machines.
// Buffers freed by their tensors return here and are handed out again for the next
// step instead. Bounded by TPCORE_CPU_CACHE_MB (default 4096, 0 disables).
#pragma once

#include <ATen/core/Tensor.h>

namespace tpcore {

// An uninitialised contiguous CPU tensor, from the cache when a buffer of the same
// size is free there.
at::Tensor empty_cached_cpu(at::IntArrayRef shape, at::ScalarType dtype);
// Frees every cached buffer; returns how many bytes were released.
int64_t empty_cpu_cache();

}  // namespace tpcore
