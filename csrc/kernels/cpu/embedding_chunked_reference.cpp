// CPU reference of the CUDA embedding backward (kernels/cuda/embedding_kernels.cu): the same
// plan (kernels/embedding_plan.h) and the same fp32 sums in the same order, as loops, so
// that the plan is tested where no GPU is. Tests call it; the layers use embedding_cpu.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>

#include <vector>

#include "kernels/embedding_plan.h"
#include "kernels/kernels.h"

namespace tpcore {

std::tuple<at::Tensor, int64_t, int64_t> embedding_backward_chunked_reference(
    const at::Tensor& ids_, const at::Tensor& grad_out, int64_t rows, int64_t vocab_start,
    int64_t padding_idx) {
  namespace plan = embedding_plan;
  const at::Tensor ids = ids_.reshape({-1}).to(at::kCPU, at::kLong).contiguous();
  const at::Tensor grad = grad_out.to(at::kCPU, at::kFloat).contiguous();
  const int64_t n = ids.numel(), dim = grad.size(1);
  at::Tensor grad_weight = at::zeros({rows, dim}, grad.options());
  if (n == 0 || rows == 0) return {grad_weight.to(grad_out.scalar_type()), 0, 0};
  // The keys and their stable sort, as in embedding_backward_cuda.
  // (The method forms of `ids - vocab_start` and `(local >= 0) & (local < rows) &
  // (ids != padding_idx)`: ATen/TensorOperators.h would pull in all of ATen/Functions.h.)
  const at::Tensor local = ids.sub(vocab_start);
  const at::Tensor keep = local.ge(0).bitwise_and(local.lt(rows)).bitwise_and(ids.ne(padding_idx));
  const at::Tensor keys = at::where(keep, local, at::full_like(local, rows));
  auto [sorted, order_t] = at::sort(keys, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  const int64_t* sk = sorted.data_ptr<int64_t>();
  const int64_t* order = order_t.data_ptr<int64_t>();
  const float* g = grad.data_ptr<float>();
  float* gw = grad_weight.data_ptr<float>();
  // shared_chunk_kernel, then the inclusive cumsum of its flags.
  std::vector<int64_t> slot_end(n);
  int64_t used = 0;
  for (int64_t i = 0; i < n; ++i) slot_end[i] = used += plan::shared_chunk(sk, i, n, rows);
  const int64_t slots = plan::max_shared_chunks(n);
  TORCH_CHECK(used <= slots, "tpcore: embedding plan: ", used, " shared chunks exceed the bound ",
              slots);
  std::vector<float> partial(slots * dim);
  std::vector<int64_t> partial_row(slots, -1);
  // chunk_sum_kernel.
  for (int64_t i = 0; i < n; ++i) {
    if (!plan::chunk_start(sk, i, rows)) continue;
    const int64_t end = plan::chunk_end(sk, i, n);
    const bool shared = plan::shared_chunk(sk, i, n, rows);
    float* dst = shared ? partial.data() + (slot_end[i] - 1) * dim : gw + sk[i] * dim;
    for (int64_t c = 0; c < dim; ++c) {
      float acc = 0.f;
      for (int64_t j = i; j < end; ++j) acc += g[order[j] * dim + c];
      dst[c] = acc;
    }
    if (shared) partial_row[slot_end[i] - 1] = sk[i];
  }
  // combine_kernel.
  for (int64_t i = 0; i < n; ++i) {
    if (!plan::shared_chunk(sk, i, n, rows) || !plan::segment_start(sk, i)) continue;
    float* dst = gw + sk[i] * dim;
    for (int64_t c = 0; c < dim; ++c) {
      float acc = 0.f;
      for (int64_t s = slot_end[i] - 1; s < slots && partial_row[s] == sk[i]; ++s)
        acc += partial[s * dim + c];
      dst[c] = acc;
    }
  }
  return {grad_weight.to(grad_out.scalar_type()), used, slots};
}

}  // namespace tpcore
