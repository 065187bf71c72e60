// CUDA kernels of the vocab-parallel embedding: masked lookup, deterministic backward
// (chunked per row, see kernels/embedding_plan.h). No host synchronisation.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <initializer_list>
#include <type_traits>

#include "kernels/cuda/vec.cuh"
#include "kernels/embedding_plan.h"
#include "kernels/kernels.h"

namespace tpcore {
namespace {

namespace plan = embedding_plan;

constexpr int kThreads = 256;
constexpr int kSumThreads = 128;  // threads per column tile of the backward

// One block per token (grid-stride): copy its row if it lives here, zeros otherwise,
// VEC elements per load (dim % VEC == 0, rows 16-byte aligned when VEC > 1).
template <typename T, int VEC>
__global__ void lookup_kernel(const int64_t* __restrict__ ids, const T* __restrict__ weight,
                              T* __restrict__ out, int64_t n, int64_t rows, int64_t dim,
                              int64_t vocab_start) {
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    const int64_t local = ids[t] - vocab_start;
    const bool mine = local >= 0 && local < rows;
    T* dst = out + t * dim;
    const T* src = weight + (mine ? local : 0) * dim;
    for (int64_t c = threadIdx.x * VEC; c < dim; c += blockDim.x * VEC) {
      Pack<T, VEC> p;
      if (mine) {
        p = load_pack<VEC>(src + c);
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) p.v[k] = T(0);
      }
      store_pack<VEC>(dst + c, p);
    }
  }
}

// fp32 partial sums, 16 bytes at a time where VEC allows (dim % VEC == 0 keeps them aligned).
template <int VEC>
__device__ __forceinline__ void store_floats(float* dst, const float (&acc)[VEC]) {
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int k = 0; k < VEC; k += 4) {
      Pack<float, 4> p;
#pragma unroll
      for (int q = 0; q < 4; ++q) p.v[q] = acc[k + q];
      store_pack<4>(dst + k, p);
    }
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) dst[k] = acc[k];
  }
}

template <int VEC>
__device__ __forceinline__ void add_floats(float (&acc)[VEC], const float* src) {
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int k = 0; k < VEC; k += 4) {
      const Pack<float, 4> p = load_pack<4>(src + k);
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[k + q] += p.v[q];
    }
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] += src[k];
  }
}

// flag[i] = 1 where a chunk that shares its row with other chunks starts.
__global__ void shared_chunk_kernel(const int64_t* __restrict__ sk, int32_t* __restrict__ flag,
                                    int64_t n, int64_t rows) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    flag[i] = plan::shared_chunk(sk, i, n, rows) ? 1 : 0;
}

// One block per chunk start (grid-stride over positions; blockIdx.y picks a tile of
// kSumThreads * VEC columns): the chunk's token gradients summed in token order in fp32,
// into grad_weight when the chunk is its row's only one, else into its partial slot.
template <typename T, int VEC>
__global__ void chunk_sum_kernel(const T* __restrict__ grad, const int64_t* __restrict__ sk,
                                 const int64_t* __restrict__ order,
                                 const int32_t* __restrict__ shared,
                                 const int64_t* __restrict__ slot_end, int64_t n, int64_t rows,
                                 int64_t dim, float* __restrict__ partial,
                                 int64_t* __restrict__ partial_row, T* __restrict__ grad_weight) {
  const int64_t c = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * VEC;
  if (c >= dim) return;
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    if (!plan::chunk_start(sk, i, rows)) continue;
    const int64_t end = plan::chunk_end(sk, i, n);
    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = 0.f;
    for (int64_t j = i; j < end; ++j) {
      const Pack<T, VEC> g = load_pack<VEC>(grad + order[j] * dim + c);
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[k] += static_cast<float>(g.v[k]);
    }
    if (shared[i]) {
      const int64_t s = slot_end[i] - 1;  // inclusive count of shared chunks up to i
      store_floats<VEC>(partial + s * dim + c, acc);
      if (c == 0) partial_row[s] = sk[i];
    } else {
      Pack<T, VEC> out;
#pragma unroll
      for (int k = 0; k < VEC; ++k) out.v[k] = static_cast<T>(acc[k]);
      store_pack<VEC>(grad_weight + sk[i] * dim + c, out);
    }
  }
}

// One block per row with several chunks (at its segment start): its partial slots, which
// are consecutive, summed in order.
template <typename T, int VEC>
__global__ void combine_kernel(const int64_t* __restrict__ sk, const int32_t* __restrict__ shared,
                               const int64_t* __restrict__ slot_end,
                               const float* __restrict__ partial,
                               const int64_t* __restrict__ partial_row, int64_t n, int64_t slots,
                               int64_t dim, T* __restrict__ grad_weight) {
  const int64_t c = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * VEC;
  if (c >= dim) return;
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    if (!shared[i] || !plan::segment_start(sk, i)) continue;
    const int64_t row = sk[i];
    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = 0.f;
    for (int64_t s = slot_end[i] - 1; s < slots && partial_row[s] == row; ++s) {
      add_floats<VEC>(acc, partial + s * dim + c);
    }
    Pack<T, VEC> out;
#pragma unroll
    for (int k = 0; k < VEC; ++k) out.v[k] = static_cast<T>(acc[k]);
    store_pack<VEC>(grad_weight + row * dim + c, out);
  }
}

template <typename T>
int vec_width(int64_t dim, std::initializer_list<const void*> ptrs) {
  if (dim % kVec16<T> != 0) return 1;
  for (const void* p : ptrs)
    if (!aligned16(p)) return 1;
  return kVec16<T>;
}

template <typename T, int VEC>
void launch_backward(const at::Tensor& grad_out, const at::Tensor& sorted, const at::Tensor& order,
                     int64_t rows, at::Tensor& grad_weight, cudaStream_t stream) {
  const int64_t n = sorted.numel(), dim = grad_out.size(1);
  const int64_t tiles = (dim / VEC + kSumThreads - 1) / kSumThreads;
  TORCH_CHECK(tiles <= 65535, "tpcore: embedding backward: embedding dim ", dim, " is too wide");
  const auto idx = sorted.options();
  at::Tensor shared = at::empty({n}, idx.dtype(at::kInt));
  shared_chunk_kernel<<<grid_blocks((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      sorted.data_ptr<int64_t>(), shared.data_ptr<int32_t>(), n, rows);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const at::Tensor slot_end = at::cumsum(shared, 0, at::kLong);
  const int64_t slots = plan::max_shared_chunks(n);
  at::Tensor partial = at::empty({slots, dim}, grad_out.options().dtype(at::kFloat));
  at::Tensor partial_row = at::full({slots}, -1, idx);
  const dim3 grid(static_cast<unsigned>(grid_blocks(n)), static_cast<unsigned>(tiles));
  chunk_sum_kernel<T, VEC><<<grid, kSumThreads, 0, stream>>>(
      grad_out.data_ptr<T>(), sorted.data_ptr<int64_t>(), order.data_ptr<int64_t>(),
      shared.data_ptr<int32_t>(), slot_end.data_ptr<int64_t>(), n, rows, dim,
      partial.data_ptr<float>(), partial_row.data_ptr<int64_t>(), grad_weight.data_ptr<T>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  combine_kernel<T, VEC><<<grid, kSumThreads, 0, stream>>>(
      sorted.data_ptr<int64_t>(), shared.data_ptr<int32_t>(), slot_end.data_ptr<int64_t>(),
      partial.data_ptr<float>(), partial_row.data_ptr<int64_t>(), n, slots, dim,
      grad_weight.data_ptr<T>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void embedding_lookup_cuda(const at::Tensor& ids, const at::Tensor& weight, int64_t vocab_start,
                           const at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(weight.device());
  const int64_t n = ids.numel(), rows = weight.size(0), dim = weight.size(1);
  if (n == 0 || dim == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, weight.scalar_type(), "emb_lookup", [&] {
        const auto* w = weight.data_ptr<scalar_t>();
        auto* o = out.data_ptr<scalar_t>();
        const auto launch = [&](auto vec) {
          lookup_kernel<scalar_t, decltype(vec)::value><<<grid_blocks(n), kThreads, 0, stream>>>(
              ids.data_ptr<int64_t>(), w, o, n, rows, dim, vocab_start);
        };
        if (vec_width<scalar_t>(dim, {w, o}) > 1) {
          launch(std::integral_constant<int, kVec16<scalar_t>>{});
        } else {
          launch(std::integral_constant<int, 1>{});
        }
      });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor embedding_backward_cuda(const at::Tensor& ids, const at::Tensor& grad_out, int64_t rows,
                                   int64_t vocab_start, int64_t padding_idx) {
  const c10::cuda::CUDAGuard guard(grad_out.device());
  const int64_t dim = grad_out.size(1);
  at::Tensor grad_weight = at::zeros({rows, dim}, grad_out.options());
  if (ids.numel() == 0 || rows == 0 || dim == 0) return grad_weight;
  // Tokens of other ranks (and padding_idx) get key `rows`, which sorts last and is dropped.
  const at::Tensor local = ids - vocab_start;
  const at::Tensor keep = (local >= 0) & (local < rows) & (ids != padding_idx);
  const at::Tensor keys = at::where(keep, local, at::full_like(local, rows));
  auto [sorted, order] = at::sort(keys, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_out.scalar_type(), "emb_bwd", [&] {
    if (vec_width<scalar_t>(dim, {grad_out.data_ptr(), grad_weight.data_ptr()}) > 1) {
      launch_backward<scalar_t, kVec16<scalar_t>>(grad_out, sorted, order, rows, grad_weight,
                                                  stream);
    } else {
      launch_backward<scalar_t, 1>(grad_out, sorted, order, rows, grad_weight, stream);
    }
  });
  return grad_weight;
}

}  // namespace tpcore
