// Typed dispatcher handles of the primitives, looked up once.
#include "ops/primitives.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace tpcore::op {
// The operator's handle, found on first use (TORCH_LIBRARY has run by then).
#define TPCORE_OP(name, ...) \
  static const auto op =     \
      c10::Dispatcher::singleton().findSchemaOrThrow("tpcore::" name, "").typed<__VA_ARGS__>()

at::Tensor all_reduce(const at::Tensor& input, GroupName group) {
  TPCORE_OP("all_reduce", at::Tensor(const at::Tensor&, GroupName));
  return op.call(input, group);
}

at::Tensor all_gather(const at::Tensor& input, int64_t dim, GroupName group) {
  TPCORE_OP("all_gather", at::Tensor(const at::Tensor&, int64_t, GroupName));
  return op.call(input, dim, group);
}

at::Tensor reduce_scatter(const at::Tensor& input, int64_t dim, GroupName group) {
  TPCORE_OP("reduce_scatter", at::Tensor(const at::Tensor&, int64_t, GroupName));
  return op.call(input, dim, group);
}

at::Tensor split(const at::Tensor& input, int64_t dim, GroupName group) {
  TPCORE_OP("split", at::Tensor(const at::Tensor&, int64_t, GroupName));
  return op.call(input, dim, group);
}

at::Tensor broadcast(const at::Tensor& input, int64_t src, GroupName group) {
  TPCORE_OP("broadcast", at::Tensor(const at::Tensor&, int64_t, GroupName));
  return op.call(input, src, group);
}

at::Tensor all_reduce_start(const at::Tensor& input, GroupName group) {
  TPCORE_OP("all_reduce_start", at::Tensor(const at::Tensor&, GroupName));
  return op.call(input, group);
}

at::Tensor all_gather_start(const at::Tensor& input, GroupName group) {
  TPCORE_OP("all_gather_start", at::Tensor(const at::Tensor&, GroupName));
  return op.call(input, group);
}

at::Tensor reduce_scatter_start(const at::Tensor& input, GroupName group) {
  TPCORE_OP("reduce_scatter_start", at::Tensor(const at::Tensor&, GroupName));
  return op.call(input, group);
}

at::Tensor wait_tensor(const at::Tensor& started) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("_c10d_functional::wait_tensor", "")
                             .typed<at::Tensor(const at::Tensor&)>();
  return op.call(started);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> column_parallel_linear_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    GroupName group, bool sequence_parallel, std::array<bool, 3> output_mask) {
  using Sig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                             const at::Tensor&, GroupName, bool,
                                                             std::array<bool, 3>);
  TPCORE_OP("column_parallel_linear_backward", Sig);
  return op.call(grad_output, input, weight, group, sequence_parallel, output_mask);
}

at::Tensor row_parallel_linear_forward(const at::Tensor& input, const at::Tensor& weight,
                                       GroupName group, bool sequence_parallel) {
  TPCORE_OP("row_parallel_linear_forward",
            at::Tensor(const at::Tensor&, const at::Tensor&, GroupName, bool));
  return op.call(input, weight, group, sequence_parallel);
}

at::Tensor vocab_parallel_embedding_forward(const at::Tensor& ids, const at::Tensor& weight,
                                            GroupName group, int64_t num_embeddings,
                                            bool sequence_parallel) {
  TPCORE_OP("vocab_parallel_embedding_forward",
            at::Tensor(const at::Tensor&, const at::Tensor&, GroupName, int64_t, bool));
  return op.call(ids, weight, group, num_embeddings, sequence_parallel);
}

at::Tensor vocab_parallel_embedding_backward(const at::Tensor& grad, const at::Tensor& ids,
                                             c10::SymInt rows, int64_t padding_idx, GroupName group,
                                             bool sequence_parallel) {
  TPCORE_OP("vocab_parallel_embedding_backward", at::Tensor(const at::Tensor&, const at::Tensor&,
                                                            c10::SymInt, int64_t, GroupName, bool));
  return op.call(grad, ids, rows, padding_idx, group, sequence_parallel);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_entropy_forward(
    const at::Tensor& logits, const at::Tensor& target, GroupName group, int64_t vocab_size,
    double label_smoothing, int64_t ignore_index, double z_loss) {
  using Sig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, GroupName, int64_t, double, int64_t, double);
  TPCORE_OP("cross_entropy_forward", Sig);
  return op.call(logits, target, group, vocab_size, label_smoothing, ignore_index, z_loss);
}

at::Tensor cross_entropy_backward(const at::Tensor& logits, const at::Tensor& target,
                                  const at::Tensor& lse, const at::Tensor& scale, GroupName group,
                                  int64_t vocab_size, double label_smoothing, double z_loss) {
  using Sig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         GroupName, int64_t, double, double);
  TPCORE_OP("cross_entropy_backward", Sig);
  return op.call(logits, target, lse, scale, group, vocab_size, label_smoothing, z_loss);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_forward(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target, GroupName group,
    int64_t vocab_size, double label_smoothing, int64_t ignore_index, double z_loss,
    int64_t chunk_size) {
  using Sig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                             const at::Tensor&, GroupName, int64_t,
                                                             double, int64_t, double, int64_t);
  TPCORE_OP("linear_cross_entropy_forward", Sig);
  return op.call(hidden, weight, target, group, vocab_size, label_smoothing, ignore_index, z_loss,
                 chunk_size);
}

std::tuple<at::Tensor, at::Tensor> linear_cross_entropy_backward(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
    const at::Tensor& lse, const at::Tensor& scale, GroupName group, int64_t vocab_size,
    double label_smoothing, double z_loss, int64_t chunk_size, std::array<bool, 2> output_mask) {
  using Sig = std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      GroupName, int64_t, double, double, int64_t, std::array<bool, 2>);
  TPCORE_OP("linear_cross_entropy_backward", Sig);
  return op.call(hidden, weight, target, lse, scale, group, vocab_size, label_smoothing, z_loss,
                 chunk_size, output_mask);
}

at::Tensor dropout_apply(const at::Tensor& input, const at::Tensor& rng_state, double p) {
  TPCORE_OP("dropout_apply", at::Tensor(const at::Tensor&, const at::Tensor&, double));
  return op.call(input, rng_state, p);
}

}  // namespace tpcore::op
