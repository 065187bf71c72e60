// Host side of the CUDA cross-entropy kernels (cross_entropy_kernels.cu holds the kernels).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda/launchers.h"
#include "kernels/kernels.h"

namespace tpcore {

at::Tensor cross_entropy_stats_cuda(const at::Tensor& logits, const at::Tensor& target,
                                    int64_t vocab_start, int64_t valid) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0);
  at::Tensor stats = at::empty({rows, 4}, logits.options().dtype(at::kFloat));
  if (rows == 0) return stats;
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "ce_stats", [&] {
    cuda_launch::cross_entropy_stats<scalar_t>(
        logits.data_ptr<scalar_t>(), target.data_ptr<int64_t>(), stats.data_ptr<float>(), rows,
        logits.size(1), vocab_start, valid, grid_blocks(rows), stream);
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
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "ce_grad", [&] {
    cuda_launch::cross_entropy_grad<scalar_t>(
        logits.data_ptr<scalar_t>(), target.data_ptr<int64_t>(), lse.data_ptr<float>(),
        scale.data_ptr<float>(), out.data_ptr<scalar_t>(), rows, logits.size(1), vocab_start, valid,
        1.f / static_cast<float>(vocab), static_cast<float>(smoothing), static_cast<float>(z_loss),
        grid_blocks(rows), stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace tpcore
