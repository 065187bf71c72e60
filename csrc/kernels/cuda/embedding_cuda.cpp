// Host side of the CUDA embedding kernels (embedding_kernels.cu holds the kernels): the
// masked lookup, and the deterministic backward's sort, buffers and three launches.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <initializer_list>

#include "kernels/cuda/launchers.h"
#include "kernels/embedding_plan.h"
#include "kernels/kernels.h"

namespace tpcore {
namespace {

namespace plan = embedding_plan;

constexpr int kThreads = cuda_launch::kEmbeddingThreads;
constexpr int kSumThreads = cuda_launch::kEmbeddingSumThreads;

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
  cuda_launch::embedding_shared_chunks(sorted.data_ptr<int64_t>(), shared.data_ptr<int32_t>(), n,
                                       rows, grid_blocks((n + kThreads - 1) / kThreads), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const at::Tensor slot_end = at::cumsum(shared, 0, at::kLong);
  const int64_t slots = plan::max_shared_chunks(n);
  at::Tensor partial = at::empty({slots, dim}, grad_out.options().dtype(at::kFloat));
  at::Tensor partial_row = at::full({slots}, -1, idx);
  const int64_t blocks = grid_blocks(n);
  cuda_launch::embedding_chunk_sum<T, VEC>(
      grad_out.data_ptr<T>(), sorted.data_ptr<int64_t>(), order.data_ptr<int64_t>(),
      shared.data_ptr<int32_t>(), slot_end.data_ptr<int64_t>(), n, rows, dim,
      partial.data_ptr<float>(), partial_row.data_ptr<int64_t>(), grad_weight.data_ptr<T>(), blocks,
      tiles, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  cuda_launch::embedding_combine<T, VEC>(sorted.data_ptr<int64_t>(), shared.data_ptr<int32_t>(),
                                         slot_end.data_ptr<int64_t>(), partial.data_ptr<float>(),
                                         partial_row.data_ptr<int64_t>(), n, slots, dim,
                                         grad_weight.data_ptr<T>(), blocks, tiles, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void embedding_lookup_cuda(const at::Tensor& ids, const at::Tensor& weight, int64_t vocab_start,
                           const at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(weight.device());
  const int64_t n = ids.numel(), rows = weight.size(0), dim = weight.size(1);
  if (n == 0 || dim == 0) return;
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, weight.scalar_type(), "emb_lookup", [&] {
        const auto* w = weight.data_ptr<scalar_t>();
        auto* o = out.data_ptr<scalar_t>();
        if (vec_width<scalar_t>(dim, {w, o}) > 1) {
          cuda_launch::embedding_lookup<scalar_t, kVec16<scalar_t>>(
              ids.data_ptr<int64_t>(), w, o, n, rows, dim, vocab_start, grid_blocks(n), stream);
        } else {
          cuda_launch::embedding_lookup<scalar_t, 1>(ids.data_ptr<int64_t>(), w, o, n, rows, dim,
                                                     vocab_start, grid_blocks(n), stream);
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
  // The method forms of `ids - vocab_start` and `(local >= 0) & (local < rows) &
  // (ids != padding_idx)` (ATen/TensorOperators.h would pull in all of ATen/Functions.h).
  const at::Tensor local = ids.sub(vocab_start);
  const at::Tensor keep = local.ge(0).bitwise_and(local.lt(rows)).bitwise_and(ids.ne(padding_idx));
  const at::Tensor keys = at::where(keep, local, at::full_like(local, rows));
  auto [sorted, order] = at::sort(keys, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  auto stream = c10::cuda::getCurrentCUDAStream();
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
