// Vocab-parallel embedding (Megatron-LM): each rank holds rows [start, start + rows)
// of the (padded) table. Forward: fused masked lookup (ids of other ranks give zeros),
// then an all-reduce, or a reduce-scatter along the sequence with sequence
// parallelism. Backward: gradient accumulated into the local rows only, deterministically.
#include <ATen/ATen.h>

#include "kernels/kernels.h"
#include "tensor_parallel/autograd_util.h"
#include "tensor_parallel/input_checks.h"
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
                            GroupName group, int64_t num_embeddings, int64_t padding_idx,
                            bool sequence_parallel) {
    save_group(ctx, group);
    ctx->saved_data["rows"] = weight.sym_size(0);
    ctx->saved_data["padding_idx"] = padding_idx;
    ctx->saved_data["sequence_parallel"] = sequence_parallel;
    ctx->save_for_backward({ids.reshape({-1}).to(at::kLong).contiguous()});
    return op::vocab_parallel_embedding_forward(ids, weight, group, num_embeddings,
                                                sequence_parallel);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& d = ctx->saved_data;
    at::Tensor grad_weight = op::vocab_parallel_embedding_backward(
        grads[0], ctx->get_saved_variables()[0], d["rows"].toSymInt(), d["padding_idx"].toInt(),
        load_group(ctx), d["sequence_parallel"].toBool());
    return {at::Tensor(), grad_weight, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

void check_token_dtype(const char* what, const at::Tensor& ids) {
  TORCH_CHECK_TYPE(!at::isFloatingType(ids.scalar_type()) &&
                       !at::isComplexType(ids.scalar_type()) && ids.scalar_type() != at::kBool,
                   "tpcore: ", what, ": token ids must be an integer tensor, got ",
                   ids.scalar_type());
}

void check_token_ids(const char* what, const at::Tensor& ids, int64_t vocab_size) {
  check_token_dtype(what, ids);
  if (ids.numel() == 0 || !should_check_values(ids)) return;
  // One host sync buys a clear error instead of a device-side assert or silent zeros
  // (tpcore.set_input_checks(False) trades it away; skipped under CUDA graph capture).
  auto [lo, hi] = at::aminmax(ids);
  // Both bounds in one device-to-host copy.
  const at::Tensor bounds = at::stack({lo, hi}).to(at::kCPU, at::kLong);
  const int64_t min_id = bounds[0].item<int64_t>(), max_id = bounds[1].item<int64_t>();
  TORCH_CHECK_INDEX(min_id >= 0 && max_id < vocab_size, "tpcore: ", what, ": token id ",
                    min_id < 0 ? min_id : max_id, " is out of range [0, ", vocab_size, ")");
}

at::Tensor vocab_parallel_embedding_forward_kernel(const at::Tensor& ids, const at::Tensor& weight,
                                                   GroupName name, int64_t num_embeddings,
                                                   bool sequence_parallel) {
  const Group group = group_by_name(name);
  // Here, not in vocab_parallel_embedding: it reads the ids' values (a host sync), which a
  // traced (fake) tensor does not have. Every rank checks before the collective.
  check_token_ids("VocabParallelEmbedding", ids, num_embeddings);
  const at::Tensor flat_ids = ids.reshape({-1}).to(at::kLong).contiguous();
  auto shape = ids.sizes().vec();
  shape.push_back(weight.size(1));
  // _unsafe_view: the reshaped kernel output is not an autograd view (its base is a temporary
  // nobody else sees), so callers may change the embedding in place (`x += positions`), as
  // with nn.Embedding; a view returned from an autograd Function forbids that.
  at::Tensor local = at::_unsafe_view(
      lookup(flat_ids, weight.contiguous(), group_rank(group) * weight.size(0)), shape);
  if (sequence_parallel) return reduce_scatter(local, 0, group).contiguous();
  return all_reduce_inplace_async(local, group).wait();
}

at::Tensor vocab_parallel_embedding_backward_kernel(const at::Tensor& grad_, const at::Tensor& ids,
                                                    c10::SymInt rows, int64_t padding_idx,
                                                    GroupName name, bool sequence_parallel) {
  const int64_t table_rows = rows.expect_int();
  const Group group = group_by_name(name);
  at::Tensor grad = sequence_parallel ? all_gather(grad_, 0, group) : grad_;
  grad = grad.reshape({-1, grad.size(-1)}).contiguous();
  return lookup_backward(ids, grad, table_rows, group_rank(group) * table_rows, padding_idx);
}

at::Tensor vocab_parallel_embedding(const at::Tensor& ids, const at::Tensor& weight, GroupName name,
                                    int64_t num_embeddings, int64_t padding_idx,
                                    bool sequence_parallel) {
  const char* what = "VocabParallelEmbedding";
  const int world = group_size(group_by_name(name));
  TORCH_CHECK_VALUE(weight.dim() == 2, "tpcore: ", what, ": weight must be 2-D, got ",
                    weight.sym_sizes());
  TORCH_CHECK_VALUE(holds(weight.sym_size(0) * world >= num_embeddings), "tpcore: ", what,
                    ": num_embeddings ", num_embeddings, " exceeds the sharded table (",
                    weight.sym_size(0), " rows x ", world, " ranks)");
  TORCH_CHECK_VALUE(ids.device() == weight.device(), "tpcore: ", what, ": token ids are on ",
                    ids.device(), " but the weight is on ", weight.device());
  check_token_dtype(what, ids);  // the values are checked where they are real (the kernel)
  if (sequence_parallel) {
    TORCH_CHECK_VALUE(ids.dim() >= 1 && holds(ids.sym_size(0) % world == 0), "tpcore: ", what,
                      ": with sequence parallelism dim 0 (sequence) of the ids, shape ",
                      ids.sym_sizes(), ", must be divisible by the tensor-parallel size ", world);
  }
  return VocabParallelEmbeddingFn::apply(ids, weight, name, num_embeddings, padding_idx,
                                         sequence_parallel);
}

}  // namespace tpcore
