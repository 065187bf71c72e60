// Host side of the CUDA dropout (dropout_kernels.cu holds the kernel).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda/launchers.h"
#include "kernels/kernels.h"

namespace tpcore {

at::Tensor dropout_cuda(const at::Tensor& input, const at::Tensor& state, uint32_t threshold,
                        double scale) {
  constexpr int kThreads = cuda_launch::kDropoutThreads;
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = input.contiguous();
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t n = x.numel();
  if (n == 0) return out;
  const int64_t blocks = grid_blocks((n + 4 * kThreads - 1) / (4 * kThreads));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "tpcore_dropout", [&] {
    cuda_launch::dropout<scalar_t>(x.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
                                   n, state.const_data_ptr<int64_t>(), threshold, scale, blocks,
                                   stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace tpcore
