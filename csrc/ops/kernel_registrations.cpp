// Kernels of tpcore's custom operators (schemas in ops/schemas.cpp): the primitives' CPU and
// CUDA kernels (one device-generic function each; the device of the input picks the code
// inside) and the layer ops' CompositeImplicitAutograd kernels. Fake kernels are in Python
// (tpcore/_fake_ops.py).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "tensor_parallel/functions.h"

namespace tpcore {
namespace {

// A collective's result as a fresh contiguous tensor: an operator's output must not alias
// its input (a group of one returns the input itself).
at::Tensor fresh(const at::Tensor& out, const at::Tensor& input) {
  if (out.is_alias_of(input)) return out.clone(at::MemoryFormat::Contiguous);
  return out.contiguous();
}

at::Tensor all_reduce_kernel(const at::Tensor& input, GroupName group) {
  return fresh(all_reduce(input, group_by_name(group)), input);
}
at::Tensor all_gather_kernel(const at::Tensor& input, int64_t dim, GroupName group) {
  return fresh(all_gather(input, dim, group_by_name(group)), input);
}
at::Tensor reduce_scatter_kernel(const at::Tensor& input, int64_t dim, GroupName group) {
  return fresh(reduce_scatter(input, dim, group_by_name(group)), input);
}
at::Tensor broadcast_kernel(const at::Tensor& input, int64_t src, GroupName group) {
  return fresh(broadcast(input, src, group_by_name(group)), input);
}
at::Tensor split_kernel(const at::Tensor& input, int64_t dim, GroupName group) {
  return fresh(split_along_dim(input, dim, group_by_name(group)), input);
}

void register_primitives(torch::Library& m) {
  m.impl("all_reduce", all_reduce_kernel);
  m.impl("all_gather", all_gather_kernel);
  m.impl("reduce_scatter", reduce_scatter_kernel);
  m.impl("broadcast", broadcast_kernel);
  m.impl("split", split_kernel);
  m.impl("column_parallel_linear_backward", column_parallel_linear_backward_kernel);
  m.impl("row_parallel_linear_forward", row_parallel_linear_forward_kernel);
  m.impl("vocab_parallel_embedding_forward", vocab_parallel_embedding_forward_kernel);
  m.impl("vocab_parallel_embedding_backward", vocab_parallel_embedding_backward_kernel);
  m.impl("cross_entropy_forward", cross_entropy_forward_kernel);
  m.impl("cross_entropy_backward", cross_entropy_backward_kernel);
  m.impl("linear_cross_entropy_forward", linear_cross_entropy_forward_kernel);
  m.impl("linear_cross_entropy_backward", linear_cross_entropy_backward_kernel);
  m.impl("dropout_apply", dropout_apply_kernel);
  m.impl("rng_state_copy", rng_state_copy_kernel);
}

}  // namespace

TORCH_LIBRARY_IMPL(tpcore, CPU, m) { register_primitives(m); }
TORCH_LIBRARY_IMPL(tpcore, CUDA, m) { register_primitives(m); }

TORCH_LIBRARY_IMPL(tpcore, CompositeImplicitAutograd, m) {
  m.impl("copy_to_tensor_parallel", copy_to_tensor_parallel);
  m.impl("reduce_from_tensor_parallel", reduce_from_tensor_parallel);
  m.impl("scatter_to_tensor_parallel", scatter_to_tensor_parallel);
  m.impl("gather_from_tensor_parallel", gather_from_tensor_parallel);
  m.impl("scatter_to_sequence_parallel", scatter_to_sequence_parallel);
  m.impl("gather_from_sequence_parallel", gather_from_sequence_parallel);
  m.impl("reduce_scatter_to_sequence_parallel", reduce_scatter_to_sequence_parallel);
  m.impl("column_parallel_linear", column_parallel_linear);
  m.impl("row_parallel_linear", row_parallel_linear);
  m.impl("vocab_parallel_embedding", vocab_parallel_embedding);
  m.impl("vocab_parallel_cross_entropy", vocab_parallel_cross_entropy);
  m.impl("vocab_parallel_linear_cross_entropy", vocab_parallel_linear_cross_entropy);
  m.impl("dropout", dropout);
}

}  // namespace tpcore
