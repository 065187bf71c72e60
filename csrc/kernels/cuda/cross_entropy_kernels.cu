// CUDA kernels of the vocab-parallel cross-entropy: per-token stats (one pass, online
// softmax) and the gradient (one read, one write), fp32 accumulation for any logits dtype.
// Light headers only: the host side is cross_entropy_cuda.cpp.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cfloat>
#include <type_traits>

#include "kernels/cuda/launchers.h"
#include "kernels/cuda/vec.cuh"

namespace tpcore {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

// Running (max, sum exp(x - max)) pairs merge associatively.
struct MaxSum {
  float m, s;
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  // fmaxf drops NaN; a NaN logit anywhere must make the row's statistics NaN.
  if (isnan(a.m) || isnan(b.m)) return {NAN, NAN};
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f};
  return {m, a.s * __expf(a.m - m) + b.s * __expf(b.m - m)};
}

// One logit into a thread's running (max, sum exp) and sum.
__device__ __forceinline__ void add_logit(MaxSum& acc, float& total, float v) {
  total += v;
  if (v > acc.m || isnan(v)) {  // a NaN becomes the max and sticks (see merge)
    acc.s = (acc.m == -INFINITY ? 0.f : acc.s * __expf(acc.m - v)) + 1.f;
    acc.m = v;
  } else if (acc.m != -INFINITY) {
    acc.s += __expf(v - acc.m);
  }
}

// One block per row, grid-stride over rows (more rows than a grid may hold). VEC > 1 needs
// 16-byte aligned rows (stride % VEC == 0).
template <typename T, int VEC>
__global__ void stats_kernel(const T* __restrict__ logits, const int64_t* __restrict__ target,
                             float* __restrict__ stats, int64_t rows, int64_t stride,
                             int64_t vocab_start, int64_t valid) {
  __shared__ MaxSum warp_acc[kWarps];
  __shared__ float warp_total[kWarps];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* x = logits + row * stride;
    MaxSum acc{-INFINITY, 0.f};
    float total = 0.f;
    // VEC columns per 16-byte load, then the last valid % VEC columns one by one.
    const int64_t packs = valid / VEC;
#pragma unroll 2
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      const Pack<T, VEC> v = load_pack<VEC>(x + p * VEC);
#pragma unroll
      for (int k = 0; k < VEC; ++k) add_logit(acc, total, static_cast<float>(v.v[k]));
    }
    for (int64_t j = packs * VEC + threadIdx.x; j < valid; j += blockDim.x)
      add_logit(acc, total, static_cast<float>(x[j]));
    for (int offset = 16; offset > 0; offset >>= 1) {
      MaxSum other{__shfl_xor_sync(0xffffffff, acc.m, offset),
                   __shfl_xor_sync(0xffffffff, acc.s, offset)};
      acc = merge(acc, other);
      total += __shfl_xor_sync(0xffffffff, total, offset);
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
      warp_acc[warp] = acc;
      warp_total[warp] = total;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      MaxSum all = warp_acc[0];
      float sum = warp_total[0];
      for (int w = 1; w < kWarps; ++w) {
        all = merge(all, warp_acc[w]);
        sum += warp_total[w];
      }
      const int64_t local = target[row] - vocab_start;
      float* out = stats + row * 4;
      out[0] = all.m;
      out[1] = all.s;
      out[2] = (local >= 0 && local < valid) ? static_cast<float>(x[local]) : 0.f;
      out[3] = sum;
    }
    __syncthreads();  // warp_acc is reused by the next row
  }
}

// VEC > 1 needs 16-byte aligned rows of a whole number of packs (stride % VEC == 0).
template <typename T, int VEC>
__global__ void grad_kernel(const T* logits, const int64_t* __restrict__ target,
                            const float* __restrict__ lse, const float* __restrict__ scale, T* out,
                            int64_t rows, int64_t stride, int64_t vocab_start, int64_t valid,
                            float inv_vocab, float smoothing, float z_loss) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* x = logits + row * stride;
    T* g_out = out + row * stride;
    const float g = scale[row], l = lse[row];
    const float a = g * (1.f + 2.f * z_loss * l), b = g * smoothing * inv_vocab;
    const int64_t local = target[row] - vocab_start;
    // Each element is loaded, then stored, by the same thread, so `out` may alias `logits`.
#pragma unroll 2
    for (int64_t p = threadIdx.x; p < stride / VEC; p += blockDim.x) {
      const Pack<T, VEC> in = load_pack<VEC>(x + p * VEC);
      Pack<T, VEC> res;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const int64_t j = p * VEC + k;
        float v = 0.f;
        if (j < valid) {
          v = __expf(static_cast<float>(in.v[k]) - l) * a - b;
          if (j == local) v -= g * (1.f - smoothing);
        }
        res.v[k] = static_cast<T>(v);
      }
      store_pack<VEC>(g_out + p * VEC, res);
    }
  }
}

}  // namespace

namespace cuda_launch {

template <typename T>
void cross_entropy_stats(const T* logits, const int64_t* target, float* stats, int64_t rows,
                         int64_t stride, int64_t vocab_start, int64_t valid, int64_t blocks,
                         cudaStream_t stream) {
  const auto launch = [&](auto vec) {
    stats_kernel<T, decltype(vec)::value>
        <<<blocks, kThreads, 0, stream>>>(logits, target, stats, rows, stride, vocab_start, valid);
  };
  if (stride % kVec16<T> == 0 && aligned16(logits)) {
    launch(std::integral_constant<int, kVec16<T>>{});
  } else {
    launch(std::integral_constant<int, 1>{});
  }
}

template <typename T>
void cross_entropy_grad(const T* logits, const int64_t* target, const float* lse,
                        const float* scale, T* out, int64_t rows, int64_t stride,
                        int64_t vocab_start, int64_t valid, float inv_vocab, float smoothing,
                        float z_loss, int64_t blocks, cudaStream_t stream) {
  const auto launch = [&](auto vec) {
    grad_kernel<T, decltype(vec)::value>
        <<<blocks, kThreads, 0, stream>>>(logits, target, lse, scale, out, rows, stride,
                                          vocab_start, valid, inv_vocab, smoothing, z_loss);
  };
  if (stride % kVec16<T> == 0 && aligned16(logits) && aligned16(out)) {
    launch(std::integral_constant<int, kVec16<T>>{});
  } else {
    launch(std::integral_constant<int, 1>{});
  }
}

#define TPCORE_INSTANTIATE(T)                                                                   \
  template void cross_entropy_stats<T>(const T*, const int64_t*, float*, int64_t, int64_t,      \
                                       int64_t, int64_t, int64_t, cudaStream_t);                \
  template void cross_entropy_grad<T>(const T*, const int64_t*, const float*, const float*, T*, \
                                      int64_t, int64_t, int64_t, int64_t, float, float, float,  \
                                      int64_t, cudaStream_t);
TPCORE_FOR_EACH_KERNEL_DTYPE(TPCORE_INSTANTIATE)
#undef TPCORE_INSTANTIATE

}  // namespace cuda_launch
}  // namespace tpcore
