// CUDA kernels of the vocab-parallel embedding: masked lookup, deterministic backward.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "kernels/kernels.h"

namespace tpcore {
namespace {

constexpr int kThreads = 256;

// One block per token (grid-stride): copy its row if it lives here, zeros otherwise.
template <typename T>
__global__ void lookup_kernel(const int64_t* __restrict__ ids, const T* __restrict__ weight,
                              T* __restrict__ out, int64_t n, int64_t rows, int64_t dim,
                              int64_t vocab_start) {
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    const int64_t local = ids[t] - vocab_start;
    const bool mine = local >= 0 && local < rows;
    T* dst = out + t * dim;
    const T* src = weight + (mine ? local : 0) * dim;
    for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) dst[c] = mine ? src[c] : T(0);
  }
}

// One block per distinct row: sums that row's token gradients in sorted (stable,
// hence token) order in fp32. No atomics, so the result is deterministic.
template <typename T>
__global__ void segment_sum_kernel(const T* __restrict__ grad, const int64_t* __restrict__ order,
                                   const int64_t* __restrict__ rows_of_segment,
                                   const int64_t* __restrict__ segment_start,
                                   const int64_t* __restrict__ segment_count, int64_t segments,
                                   int64_t dim, T* __restrict__ grad_weight) {
  for (int64_t s = blockIdx.x; s < segments; s += gridDim.x) {
    const int64_t begin = segment_start[s], end = begin + segment_count[s];
    T* dst = grad_weight + rows_of_segment[s] * dim;
    for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
      float acc = 0.f;
      for (int64_t j = begin; j < end; ++j) acc += static_cast<float>(grad[order[j] * dim + c]);
      dst[c] = static_cast<T>(acc);
    }
  }
}

}  // namespace

at::Tensor embedding_lookup_cuda(const at::Tensor& ids, const at::Tensor& weight,
                                 int64_t vocab_start) {
  const c10::cuda::CUDAGuard guard(weight.device());
  const int64_t n = ids.numel(), rows = weight.size(0), dim = weight.size(1);
  at::Tensor out = at::empty({n, dim}, weight.options());
  if (n == 0) return out;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, weight.scalar_type(), "emb_lookup", [&] {
        lookup_kernel<scalar_t><<<grid_blocks(n), kThreads, 0, stream>>>(
            ids.data_ptr<int64_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), n, rows,
            dim, vocab_start);
      });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor embedding_backward_cuda(const at::Tensor& ids, const at::Tensor& grad_out, int64_t rows,
                                   int64_t vocab_start, int64_t padding_idx) {
  const c10::cuda::CUDAGuard guard(grad_out.device());
  const int64_t dim = grad_out.size(1);
  at::Tensor grad_weight = at::zeros({rows, dim}, grad_out.options());
  if (ids.numel() == 0) return grad_weight;
  // Tokens of other ranks (and padding_idx) get key `rows`, which sorts last and is dropped.
  const at::Tensor local = ids - vocab_start;
  const at::Tensor keep = (local >= 0) & (local < rows) & (ids != padding_idx);
  const at::Tensor keys = at::where(keep, local, at::full_like(local, rows));
  auto [sorted, order] = at::sort(keys, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  auto [segment_rows, inverse, counts] = at::unique_consecutive(sorted, false, true);
  at::Tensor starts = counts.cumsum(0) - counts;
  // The last segment holds the dropped tokens when there are any.
  const bool has_dropped = !keep.all().item<bool>();
  const int64_t segments = segment_rows.numel() - (has_dropped ? 1 : 0);
  if (segments == 0) return grad_weight;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_out.scalar_type(), "emb_bwd", [&] {
    segment_sum_kernel<scalar_t><<<grid_blocks(segments), kThreads, 0, stream>>>(
        grad_out.data_ptr<scalar_t>(), order.data_ptr<int64_t>(), segment_rows.data_ptr<int64_t>(),
        starts.data_ptr<int64_t>(), counts.data_ptr<int64_t>(), segments, dim,
        grad_weight.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grad_weight;
}

}  // namespace tpcore
