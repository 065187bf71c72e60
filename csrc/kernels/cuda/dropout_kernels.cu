// CUDA kernel of the counter-based dropout (kernels/philox.h). The (seed, offset) pair is read
// from device memory inside the kernel, so a CUDA graph replays it with the values of each
// replay, and no host copy is needed.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "kernels/kernels.h"
#include "kernels/philox.h"

namespace tpcore {
namespace {

constexpr int kThreads = 256;

template <typename scalar_t>
__global__ void dropout_kernel(const scalar_t* __restrict__ in, scalar_t* __restrict__ out,
                               int64_t n, const int64_t* __restrict__ state, uint32_t threshold,
                               at::opmath_type<scalar_t> scale) {
  using acc_t = at::opmath_type<scalar_t>;
  const uint64_t seed = static_cast<uint64_t>(state[0]);
  const uint64_t first = static_cast<uint64_t>(state[1]) / 4;
  const int64_t blocks = (n + 3) / 4;
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < blocks;
       b += int64_t(gridDim.x) * blockDim.x) {
    const Philox4 r = dropout_block(seed, first + static_cast<uint64_t>(b));
    const int64_t base = b * 4;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      if (base + l < n) {
        const acc_t factor = r.v[l] >= threshold ? scale : acc_t(0);
        out[base + l] = static_cast<scalar_t>(static_cast<acc_t>(in[base + l]) * factor);
      }
    }
  }
}

}  // namespace

at::Tensor dropout_cuda(const at::Tensor& input, const at::Tensor& state, uint32_t threshold,
                        double scale) {
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = input.contiguous();
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t n = x.numel();
  if (n == 0) return out;
  const int64_t blocks = grid_blocks((n + 4 * kThreads - 1) / (4 * kThreads));
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "tpcore_dropout", [&] {
    dropout_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), n,
        state.const_data_ptr<int64_t>(), threshold, static_cast<at::opmath_type<scalar_t>>(scale));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace tpcore
