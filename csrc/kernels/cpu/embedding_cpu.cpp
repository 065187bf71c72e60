// CPU kernels of the vocab-parallel embedding: masked lookup and deterministic backward.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>

#include <cstring>

#include "kernels/kernels.h"

namespace tpcore {

void embedding_lookup_cpu(const at::Tensor& ids, const at::Tensor& weight, int64_t vocab_start,
                          const at::Tensor& out) {
  const int64_t n = ids.numel(), rows = weight.size(0), dim = weight.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  const size_t row_bytes = dim * weight.element_size();
  const char* src = static_cast<const char*>(weight.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  // One fused pass: copy the row if it lives on this rank, zeros otherwise.
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t local = id[t] - vocab_start;
      if (local >= 0 && local < rows) {
        std::memcpy(dst + t * row_bytes, src + local * row_bytes, row_bytes);
      } else {
        std::memset(dst + t * row_bytes, 0, row_bytes);
      }
    }
  });
}

at::Tensor embedding_backward_cpu(const at::Tensor& ids, const at::Tensor& grad_out, int64_t rows,
                                  int64_t vocab_start, int64_t padding_idx) {
  const int64_t n = ids.numel(), dim = grad_out.size(1);
  // Accumulate in fp32 whatever the dtype, then round once.
  at::Tensor acc = at::zeros({rows, dim}, grad_out.options().dtype(at::kFloat));
  at::Tensor grad = grad_out.to(at::kFloat).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* g = grad.data_ptr<float>();
  float* a = acc.data_ptr<float>();
  // Threads own disjoint column ranges and walk tokens in order: every element is
  // summed in the same order on every run, so the result is deterministic.
  at::parallel_for(0, dim, 256, [&](int64_t c0, int64_t c1) {
    for (int64_t t = 0; t < n; ++t) {
      const int64_t local = id[t] - vocab_start;
      if (local < 0 || local >= rows || id[t] == padding_idx) continue;
      float* dst = a + local * dim;
      const float* src = g + t * dim;
      for (int64_t c = c0; c < c1; ++c) dst[c] += src[c];
    }
  });
  return acc.to(grad_out.scalar_type());
}

}  // namespace tpcore
