// CUDA kernels of the vocab-parallel cross-entropy: per-token stats (one pass, online
// softmax) and the gradient (one read, one write), fp32 accumulation for any logits dtype.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cfloat>

#include "kernels/kernels.h"

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

// One block per row, grid-stride over rows (more rows than a grid may hold).
template <typename T>
__global__ void stats_kernel(const T* __restrict__ logits, const int64_t* __restrict__ target,
                             float* __restrict__ stats, int64_t rows, int64_t stride,
                             int64_t vocab_start, int64_t valid) {
  __shared__ MaxSum warp_acc[kWarps];
  __shared__ float warp_total[kWarps];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* x = logits + row * stride;
    MaxSum acc{-INFINITY, 0.f};
    float total = 0.f;
    for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) {
      const float v = static_cast<float>(x[j]);
      total += v;
      if (v > acc.m || isnan(v)) {  // a NaN becomes the max and sticks (see merge)
        acc.s = (acc.m == -INFINITY ? 0.f : acc.s * __expf(acc.m - v)) + 1.f;
        acc.m = v;
      } else if (acc.m != -INFINITY) {
        acc.s += __expf(v - acc.m);
      }
    }
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

template <typename T>
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
    // Each element is read then written by the same thread, so `out` may alias `logits`.
    for (int64_t j = threadIdx.x; j < stride; j += blockDim.x) {
      float v = 0.f;
      if (j < valid) {
        v = __expf(static_cast<float>(x[j]) - l) * a - b;
        if (j == local) v -= g * (1.f - smoothing);
      }
      g_out[j] = static_cast<T>(v);
    }
  }
}

}  // namespace

at::Tensor cross_entropy_stats_cuda(const at::Tensor& logits, const at::Tensor& target,
                                    int64_t vocab_start, int64_t valid) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0);
  at::Tensor stats = at::empty({rows, 4}, logits.options().dtype(at::kFloat));
  if (rows == 0) return stats;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "ce_stats", [&] {
    stats_kernel<scalar_t><<<grid_blocks(rows), kThreads, 0, stream>>>(
        logits.data_ptr<scalar_t>(), target.data_ptr<int64_t>(), stats.data_ptr<float>(), rows,
        logits.size(1), vocab_start, valid);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return stats;
}

void cross_entropy_grad_cuda(const at::Tensor& logits, const at::Tensor& target,
                             const at::Tensor& lse, const at::Tensor& scale, at::Tensor& out,
                             int64_t vocab_start, int64_t valid, int64_t vocab, double smoothing,
                             double z_loss) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0);
  if (rows == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "ce_grad", [&] {
    grad_kernel<scalar_t><<<grid_blocks(rows), kThreads, 0, stream>>>(
        logits.data_ptr<scalar_t>(), target.data_ptr<int64_t>(), lse.data_ptr<float>(),
        scale.data_ptr<float>(), out.data_ptr<scalar_t>(), rows, logits.size(1), vocab_start, valid,
        1.f / static_cast<float>(vocab), static_cast<float>(smoothing), static_cast<float>(z_loss));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace tpcore
