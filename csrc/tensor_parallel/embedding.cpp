// Vocab-parallel embedding (Megatron-LM): each rank holds rows [start, start + rows)
// of the (padded) table. Forward: fused masked lookup (ids of other ranks give zeros),
// then an all-reduce, or a reduce-scatter along the sequence with sequence
// parallelism. Backward: gradient accumulated into the local rows only, deterministically.
#include <ATen/ATen.h>

#include <algorithm>
#include <string>
#include <tuple>

#include "kernels/kernels.h"
#include "tensor_parallel/autograd_util.h"
#include "tensor_parallel/functions.h"
#include "tensor_parallel/input_checks.h"

namespace tpcore {
namespace {

// Writes the lookup of `ids` into `out` [ids, D] (contiguous rows).
void lookup_into(const at::Tensor& ids, const at::Tensor& weight, int64_t vocab_start,
                 const at::Tensor& out) {
#ifdef TPCORE_WITH_CUDA
  if (weight.is_cuda()) return embedding_lookup_cuda(ids, weight, vocab_start, out);
#endif
  TORCH_CHECK(weight.is_cpu(), "tpcore: VocabParallelEmbedding: no kernel for device ",
              weight.device(), " in this build");
  embedding_lookup_cpu(ids, weight, vocab_start, out);
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

// (min, max) of the ids, on their device, unread (no host sync); undefined when the values
// are not checked (checks off, CUDA graph capture) or there are none.
std::tuple<at::Tensor, at::Tensor> id_bounds(const at::Tensor& ids) {
  if (ids.numel() == 0 || !should_check_values(ids)) return {};
  return at::aminmax(ids);
}

// The IndexError message for ids with these bounds (see id_bounds) outside [0, vocab_size),
// else "". Reading them is a host sync on a GPU: one sync buys a clear error instead of a
// device-side assert or silent zeros (tpcore.set_input_checks(False) trades it away).
std::string id_problem(const char* what, const std::tuple<at::Tensor, at::Tensor>& bounds,
                       int64_t vocab_size) {
  const auto& [lo, hi] = bounds;
  if (!lo.defined()) return "";
  const int64_t min_id = lo.item<int64_t>(), max_id = hi.item<int64_t>();
  if (min_id >= 0 && max_id < vocab_size) return "";
  return c10::str("tpcore: ", what, ": token id ", min_id < 0 ? min_id : max_id,
                  " is out of range [0, ", vocab_size, ")");
}

}  // namespace

void check_token_dtype(const char* what, const at::Tensor& ids) {
  TORCH_CHECK_TYPE(!at::isFloatingType(ids.scalar_type()) &&
                       !at::isComplexType(ids.scalar_type()) && ids.scalar_type() != at::kBool,
                   "tpcore: ", what, ": token ids must be an integer tensor, got ",
                   ids.scalar_type());
}

void check_token_ids(const char* what, const at::Tensor& ids, int64_t vocab_size) {
  check_token_dtype(what, ids);
  const std::string problem = id_problem(what, id_bounds(ids), vocab_size);
  TORCH_CHECK_INDEX(problem.empty(), problem);
}

// The lookup, summed over the group (all-reduce, or reduce-scatter along the sequence).
// Ranks can be given different ids, so a rank whose ids are out of range must not raise
// alone: the others would wait in the collective until the timeout. Its verdict travels in
// that collective instead, as one extra row per chunk of the sum (1 in column `rank`), and
// every rank raises after it. The flag is written on the device: one host sync, after.
at::Tensor vocab_parallel_embedding_forward_kernel(const at::Tensor& ids, const at::Tensor& weight,
                                                   GroupName name, int64_t num_embeddings,
                                                   bool sequence_parallel) {
  const char* what = "VocabParallelEmbedding";
  const Group group = group_by_name(name);
  const int64_t world = group_size(group), rank = group_rank(group), dim = weight.size(1);
  // Alone, or nowhere to put the flag (a table of width 0): check before the lookup. Here,
  // not in vocab_parallel_embedding: it reads the ids' values, which a fake tensor lacks.
  const bool alone = world == 1 || dim == 0;
  if (alone) check_token_ids(what, ids, num_embeddings);
  const auto bounds = alone ? std::tuple<at::Tensor, at::Tensor>() : id_bounds(ids);
  const bool checked = std::get<0>(bounds).defined();

  const at::Tensor flat_ids = ids.reshape({-1}).to(at::kLong).contiguous();
  const at::Tensor table = weight.contiguous();
  const int64_t chunks = sequence_parallel ? world : 1, rows = flat_ids.numel() / chunks;
  at::Tensor buffer = at::empty({chunks, rows + 1, dim}, weight.options());
  for (int64_t k = 0; k < chunks; ++k)
    lookup_into(flat_ids.narrow(0, k * rows, rows), table, rank * weight.size(0),
                buffer[k].narrow(0, 0, rows));
  at::Tensor flags = buffer.select(1, rows);  // [chunks, D]
  flags.zero_();
  if (checked) {
    const auto& [lo, hi] = bounds;
    // In int64: a narrow id dtype would wrap num_embeddings (uint8 ids, vocab 256).
    const at::Tensor bad = lo.to(at::kLong).lt(0).logical_or_(hi.to(at::kLong).ge(num_embeddings));
    flags.select(1, std::min(rank, dim - 1)).copy_(bad);
  }

  at::Tensor flat = buffer.view({-1, dim});
  at::Tensor summed = sequence_parallel ? reduce_scatter(flat, 0, group)
                                        : all_reduce_inplace_async(flat, group).wait();
  // The flags' columns only, read once (the host sync on a GPU).
  const at::Tensor got =
      checked ? summed.select(0, rows).narrow(0, 0, std::min(dim, world)).to(at::kCPU)
              : at::Tensor();
  if (checked && got.ne(0).any().item<bool>()) {
    const std::string problem = id_problem(what, bounds, num_embeddings);
    TORCH_CHECK_INDEX(problem.empty(), problem);
    if (dim >= world) {  // a column per rank: name them
      TORCH_CHECK_INDEX(false, "tpcore: ", what, ": tensor-parallel rank(s) ", ranks_where(got),
                        " have a token id out of range (their error names it)");
    }
    TORCH_CHECK_INDEX(false, "tpcore: ", what,
                      ": a tensor-parallel rank has a token id out of range (its error names it)");
  }
  auto shape = ids.sizes().vec();
  if (sequence_parallel) shape[0] /= world;
  shape.push_back(dim);
  // _unsafe_view: the kernel output is not an autograd view (its base is a buffer nobody
  // else sees), so callers may change the embedding in place (`x += positions`), as with
  // nn.Embedding; a view returned from an autograd Function forbids that.
  return at::_unsafe_view(summed.narrow(0, 0, rows), shape);
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
