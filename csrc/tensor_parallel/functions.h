// tpcore's tensor-parallel functions: the layer ops (kernels of the CompositeImplicitAutograd
// custom operators, autograd inside) and the primitive kernels behind them (CPU / CUDA
// kernels of the primitive custom operators). Groups are passed by name.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <tuple>

#include "comm/comm.h"
#include "ops/primitives.h"

namespace tpcore {

using op::GroupName;

// The f / g conjugate mappings of Megatron-LM (Shoeybi et al. 2019), autograd-aware.
at::Tensor copy_to_tensor_parallel(const at::Tensor& input, GroupName group);
at::Tensor reduce_from_tensor_parallel(const at::Tensor& input, GroupName group);
at::Tensor scatter_to_tensor_parallel(const at::Tensor& input, GroupName group);
at::Tensor gather_from_tensor_parallel(const at::Tensor& input, GroupName group);
// Sequence-parallel cousins, acting on dim 0 (the sequence dimension).
at::Tensor scatter_to_sequence_parallel(const at::Tensor& input, GroupName group);
// reduce_scatter_grad=false: backward keeps this rank's chunk of an already summed gradient.
at::Tensor gather_from_sequence_parallel(const at::Tensor& input, GroupName group,
                                         bool reduce_scatter_grad);
at::Tensor reduce_scatter_to_sequence_parallel(const at::Tensor& input, GroupName group);

// y = x W^T + b with W sharded along its output features: W is [out/tp, in].
at::Tensor column_parallel_linear(const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, GroupName group,
                                  bool gather_output, bool sequence_parallel);
// y = x W^T + b with W sharded along its input features: W is [out, in/tp], b replicated.
at::Tensor row_parallel_linear(const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, GroupName group,
                               bool input_is_parallel, bool sequence_parallel);

// Lookup in a table sharded along the vocabulary: weight is this rank's [rows, D] slice,
// ids [...] are global ids in [0, num_embeddings); returns [..., D] (summed over TP), or
// this rank's sequence shard [s/tp, ..., D] with sequence parallelism.
// padding_idx < 0 means none; its row gets no gradient.
at::Tensor vocab_parallel_embedding(const at::Tensor& ids, const at::Tensor& weight,
                                    GroupName group, int64_t num_embeddings, int64_t padding_idx,
                                    bool sequence_parallel);
// Cross-entropy over logits [..., V_local] sharded along the vocabulary, equal to
// F.cross_entropy on the gathered logits restricted to the first vocab_size columns
// (vocab_size < 0: all of them). reduction: 0 none, 1 mean, 2 sum.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                        GroupName group, int64_t vocab_size, double label_smoothing,
                                        int64_t ignore_index, int64_t reduction, double z_loss,
                                        bool inplace_backward);
// The same loss on logits = hidden [..., H] @ weight [V_local, H]^T, computed chunk_size
// tokens at a time so the full logits never exist; backward recomputes each chunk.
at::Tensor vocab_parallel_linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                               const at::Tensor& target, GroupName group,
                                               int64_t vocab_size, double label_smoothing,
                                               int64_t ignore_index, int64_t reduction,
                                               double z_loss, int64_t chunk_size);
// Dropout of `input` with the mask drawn from rng_state = int64 [2] (seed, offset) on the
// input's device (kernels/philox.h); autograd-aware: backward applies the same mask.
at::Tensor dropout(const at::Tensor& input, const at::Tensor& rng_state, double p);

// Raises a TypeError unless `ids` is an integer tensor (reads no values).
void check_token_dtype(const char* what, const at::Tensor& ids);
// check_token_dtype, then an IndexError naming the id unless every id is in [0, vocab_size);
// the range is not read when input checks are off or a CUDA graph is being captured.
void check_token_ids(const char* what, const at::Tensor& ids, int64_t vocab_size);

// Primitive kernels (see ops/schemas.cpp for their operators). Shapes: logits [N, V_local],
// hidden [N, H], target / lse / scale [N]; the per-token outputs are float32 [N].
std::tuple<at::Tensor, at::Tensor, at::Tensor> column_parallel_linear_backward_kernel(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    GroupName group, bool sequence_parallel, std::array<bool, 3> output_mask);
at::Tensor row_parallel_linear_forward_kernel(const at::Tensor& input, const at::Tensor& weight,
                                              GroupName group, bool sequence_parallel);
at::Tensor vocab_parallel_embedding_forward_kernel(const at::Tensor& ids, const at::Tensor& weight,
                                                   GroupName group, int64_t num_embeddings,
                                                   bool sequence_parallel);
at::Tensor vocab_parallel_embedding_backward_kernel(const at::Tensor& grad, const at::Tensor& ids,
                                                    c10::SymInt rows, int64_t padding_idx,
                                                    GroupName group, bool sequence_parallel);
// (loss, lse, mask) per token.
std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_entropy_forward_kernel(
    const at::Tensor& logits, const at::Tensor& target, GroupName group, int64_t vocab_size,
    double label_smoothing, int64_t ignore_index, double z_loss);
at::Tensor cross_entropy_backward_kernel(const at::Tensor& logits, const at::Tensor& target,
                                         const at::Tensor& lse, const at::Tensor& scale,
                                         GroupName group, int64_t vocab_size,
                                         double label_smoothing, double z_loss);
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_forward_kernel(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target, GroupName group,
    int64_t vocab_size, double label_smoothing, int64_t ignore_index, double z_loss,
    int64_t chunk_size);
at::Tensor dropout_apply_kernel(const at::Tensor& input, const at::Tensor& rng_state, double p);
at::Tensor rng_state_copy_kernel(const at::Tensor& counter);
std::tuple<at::Tensor, at::Tensor> linear_cross_entropy_backward_kernel(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
    const at::Tensor& lse, const at::Tensor& scale, GroupName group, int64_t vocab_size,
    double label_smoothing, double z_loss, int64_t chunk_size, std::array<bool, 2> output_mask);

}  // namespace tpcore
