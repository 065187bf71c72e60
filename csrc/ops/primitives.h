// Calls of tpcore's primitive custom operators through the dispatcher. The layers'
// autograd functions use these (never the C++ functions behind them) so that under
// torch.compile / fake tensors the calls are recorded in the graph, not executed.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <array>
#include <tuple>

namespace tpcore::op {

using GroupName = c10::string_view;

at::Tensor all_reduce(const at::Tensor& input, GroupName group);
at::Tensor all_gather(const at::Tensor& input, int64_t dim, GroupName group);
at::Tensor reduce_scatter(const at::Tensor& input, int64_t dim, GroupName group);
at::Tensor split(const at::Tensor& input, int64_t dim, GroupName group);
at::Tensor broadcast(const at::Tensor& input, int64_t src, GroupName group);
// Started collectives (dim 0) and the wait that completes them (ops/started_collectives.cpp).
at::Tensor all_reduce_start(const at::Tensor& input, GroupName group);
at::Tensor all_gather_start(const at::Tensor& input, GroupName group);
at::Tensor reduce_scatter_start(const at::Tensor& input, GroupName group);
at::Tensor wait_tensor(const at::Tensor& started);

std::tuple<at::Tensor, at::Tensor, at::Tensor> column_parallel_linear_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    GroupName group, bool sequence_parallel, std::array<bool, 3> output_mask);
at::Tensor row_parallel_linear_forward(const at::Tensor& input, const at::Tensor& weight,
                                       GroupName group, bool sequence_parallel);
at::Tensor vocab_parallel_embedding_forward(const at::Tensor& ids, const at::Tensor& weight,
                                            GroupName group, int64_t num_embeddings,
                                            bool sequence_parallel);
at::Tensor vocab_parallel_embedding_backward(const at::Tensor& grad, const at::Tensor& ids,
                                             c10::SymInt rows, int64_t padding_idx, GroupName group,
                                             bool sequence_parallel);
std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_entropy_forward(
    const at::Tensor& logits, const at::Tensor& target, GroupName group, int64_t vocab_size,
    double label_smoothing, int64_t ignore_index, double z_loss);
at::Tensor cross_entropy_backward(const at::Tensor& logits, const at::Tensor& target,
                                  const at::Tensor& lse, const at::Tensor& scale, GroupName group,
                                  int64_t vocab_size, double label_smoothing, double z_loss);
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_forward(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target, GroupName group,
    int64_t vocab_size, double label_smoothing, int64_t ignore_index, double z_loss,
    int64_t chunk_size);
std::tuple<at::Tensor, at::Tensor> linear_cross_entropy_backward(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
    const at::Tensor& lse, const at::Tensor& scale, GroupName group, int64_t vocab_size,
    double label_smoothing, double z_loss, int64_t chunk_size, std::array<bool, 2> output_mask);
at::Tensor dropout_apply(const at::Tensor& input, const at::Tensor& rng_state, double p);

}  // namespace tpcore::op
