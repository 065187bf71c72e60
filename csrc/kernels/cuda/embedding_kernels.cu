// CUDA kernels of the vocab-parallel embedding: masked lookup, deterministic backward
// (chunked per row, see kernels/embedding_plan.h). No host synchronisation. Light headers
// only: the host side is embedding_cuda.cpp.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "kernels/cuda/launchers.h"
#include "kernels/cuda/vec.cuh"
#include "kernels/embedding_plan.h"

namespace tpcore {
namespace {

namespace plan = embedding_plan;

constexpr int kThreads = cuda_launch::kEmbeddingThreads;
constexpr int kSumThreads = cuda_launch::kEmbeddingSumThreads;

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

}  // namespace

namespace cuda_launch {

template <typename T, int VEC>
void embedding_lookup(const int64_t* ids, const T* weight, T* out, int64_t n, int64_t rows,
                      int64_t dim, int64_t vocab_start, int64_t blocks, cudaStream_t stream) {
  lookup_kernel<T, VEC>
      <<<blocks, kThreads, 0, stream>>>(ids, weight, out, n, rows, dim, vocab_start);
}

void embedding_shared_chunks(const int64_t* sk, int32_t* flag, int64_t n, int64_t rows,
                             int64_t blocks, cudaStream_t stream) {
  shared_chunk_kernel<<<blocks, kThreads, 0, stream>>>(sk, flag, n, rows);
}

template <typename T, int VEC>
void embedding_chunk_sum(const T* grad, const int64_t* sk, const int64_t* order,
                         const int32_t* shared, const int64_t* slot_end, int64_t n, int64_t rows,
                         int64_t dim, float* partial, int64_t* partial_row, T* grad_weight,
                         int64_t blocks, int64_t tiles, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(tiles));
  chunk_sum_kernel<T, VEC><<<grid, kSumThreads, 0, stream>>>(
      grad, sk, order, shared, slot_end, n, rows, dim, partial, partial_row, grad_weight);
}

template <typename T, int VEC>
void embedding_combine(const int64_t* sk, const int32_t* shared, const int64_t* slot_end,
                       const float* partial, const int64_t* partial_row, int64_t n, int64_t slots,
                       int64_t dim, T* grad_weight, int64_t blocks, int64_t tiles,
                       cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(tiles));
  combine_kernel<T, VEC><<<grid, kSumThreads, 0, stream>>>(sk, shared, slot_end, partial,
                                                           partial_row, n, slots, dim, grad_weight);
}

#define TPCORE_INSTANTIATE_VEC(T, VEC)                                                             \
  template void embedding_lookup<T, VEC>(const int64_t*, const T*, T*, int64_t, int64_t, int64_t,  \
                                         int64_t, int64_t, cudaStream_t);                          \
  template void embedding_chunk_sum<T, VEC>(                                                       \
      const T*, const int64_t*, const int64_t*, const int32_t*, const int64_t*, int64_t, int64_t,  \
      int64_t, float*, int64_t*, T*, int64_t, int64_t, cudaStream_t);                              \
  template void embedding_combine<T, VEC>(const int64_t*, const int32_t*, const int64_t*,          \
                                          const float*, const int64_t*, int64_t, int64_t, int64_t, \
                                          T*, int64_t, int64_t, cudaStream_t);
#define TPCORE_INSTANTIATE(T)  \
  TPCORE_INSTANTIATE_VEC(T, 1) \
  TPCORE_INSTANTIATE_VEC(T, kVec16<T>)
TPCORE_FOR_EACH_KERNEL_DTYPE(TPCORE_INSTANTIATE)
#undef TPCORE_INSTANTIATE
#undef TPCORE_INSTANTIATE_VEC

}  // namespace cuda_launch
}  // namespace tpcore
