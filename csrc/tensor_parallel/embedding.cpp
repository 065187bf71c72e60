// Vocab-parallel embedding (Megatron-LM): each rank holds rows [start, start + rows)
// of the (padded) table. Forward: fused masked lookup (ids of other ranks give zeros),
// then an all-reduce, or a reduce-scatter along the sequence with sequence
// parallelism. Backward: gradient accumulated into the local rows only, deterministically.
#include <ATen/ATen.h>

#include "kernels/kernels.h"
#include "tensor_parallel/autograd_util.h"
#include "tensor_parallel/ops.h"

namespace tpcore {
namespace {

at::Tensor lookup(const at::Tensor& ids, const at::Tensor& weight, int64_t vocab_start) {
#ifdef TPCORE_WITH_CUDA
  if (weight.is_cuda()) return embedding_lookup_cuda(ids, weight, vocab_start);
#endif
  TORCH_CHECK(weight.is_cpu(), "tpcore: VocabParallelEmbedding: no kernel for device ",
              weight.device(), " in this build");
  return embedding_lookup_cpu(ids, weight, vocab_start);
}

at::Tensor lookup_backward(const at::Tensor& ids, const at::Tensor& grad, int64_t rows,
                           int64_t vocab_start, int64_t padding_idx) {
#ifdef TPCORE_WITH_CUDA
  if (grad.is_cuda()) return embedding_backward_cuda(ids, grad, rows, vocab_start, padding_idx);
#endif
  return embedding_backward_cpu(ids, grad, rows, vocab_start, padding_idx);
}

struct VocabParallelEmbeddingFn : public torch::autograd::Function<VocabParallelEmbeddingFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& ids, const at::Tensor& weight,
                            const Group& group, int64_t padding_idx, bool sequence_parallel) {
    const int64_t vocab_start = group_rank(group) * weight.size(0);
    save_group(ctx, group);
    ctx->saved_data["rows"] = weight.size(0);
    ctx->saved_data["padding_idx"] = padding_idx;
    ctx->saved_data["sequence_parallel"] = sequence_parallel;
    const at::Tensor flat_ids = ids.reshape({-1}).to(at::kLong).contiguous();
    ctx->save_for_backward({flat_ids});
    auto shape = ids.sizes().vec();
    shape.push_back(weight.size(1));
    at::Tensor local = lookup(flat_ids, weight.contiguous(), vocab_start).view(shape);
    if (sequence_parallel) return reduce_scatter(local, 0, group);
    return all_reduce_inplace_async(local, group).wait();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Group group = load_group(ctx);
    const int64_t rows = ctx->saved_data["rows"].toInt();
    at::Tensor grad = grads[0];
    if (ctx->saved_data["sequence_parallel"].toBool()) grad = all_gather(grad, 0, group);
    grad = grad.reshape({-1, grad.size(-1)}).contiguous();
    at::Tensor grad_weight =
        lookup_backward(ctx->get_saved_variables()[0], grad, rows, group_rank(group) * rows,
                        ctx->saved_data["padding_idx"].toInt());
    return {at::Tensor(), grad_weight, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

void check_token_ids(const char* what, const at::Tensor& ids, int64_t vocab_size) {
  TORCH_CHECK_TYPE(!at::isFloatingType(ids.scalar_type()) &&
                       !at::isComplexType(ids.scalar_type()) && ids.scalar_type() != at::kBool,
                   "tpcore: ", what, ": token ids must be an integer tensor, got ",
                   ids.scalar_type());
  if (ids.numel() == 0) return;
  // One host sync buys a clear error instead of a device-side assert or silent zeros.
  auto [lo, hi] = at::aminmax(ids);
  // Both bounds in one device-to-host copy.
  const at::Tensor bounds = at::stack({lo, hi}).to(at::kCPU, at::kLong);
  const int64_t min_id = bounds[0].item<int64_t>(), max_id = bounds[1].item<int64_t>();
  TORCH_CHECK_INDEX(min_id >= 0 && max_id < vocab_size, "tpcore: ", what, ": token id ",
                    min_id < 0 ? min_id : max_id, " is out of range [0, ", vocab_size, ")");
}

at::Tensor vocab_parallel_embedding(const at::Tensor& ids, const at::Tensor& weight,
                                    const Group& group, int64_t num_embeddings, int64_t padding_idx,
                                    bool sequence_parallel) {
  const char* what = "VocabParallelEmbedding";
  const int world = group_size(group);
  TORCH_CHECK_VALUE(weight.dim() == 2, "tpcore: ", what, ": weight must be 2-D, got ",
                    weight.sizes());
  TORCH_CHECK_VALUE(num_embeddings <= weight.size(0) * world, "tpcore: ", what, ": num_embeddings ",
                    num_embeddings, " exceeds the sharded table (", weight.size(0), " rows x ",
                    world, " ranks)");
  TORCH_CHECK_VALUE(ids.device() == weight.device(), "tpcore: ", what, ": token ids are on ",
                    ids.device(), " but the weight is on ", weight.device());
  check_token_ids(what, ids, num_embeddings);
  if (sequence_parallel) {
    TORCH_CHECK_VALUE(ids.dim() >= 1 && ids.size(0) % world == 0, "tpcore: ", what,
                      ": with sequence parallelism dim 0 (sequence) of the ids, shape ",
                      ids.sizes(), ", must be divisible by the tensor-parallel size ", world);
  }
  return VocabParallelEmbeddingFn::apply(ids, weight, group, padding_idx, sequence_parallel);
}

}  // namespace tpcore
