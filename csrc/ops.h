// The C++ entry points tpcore binds into Python (tpcore._C).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "comm.h"

namespace tpcore {

// The f / g conjugate mappings of Megatron-LM (Shoeybi et al. 2019), autograd-aware.
at::Tensor copy_to_tensor_parallel(const at::Tensor& input, const Group& group);
at::Tensor reduce_from_tensor_parallel(const at::Tensor& input, const Group& group);
at::Tensor scatter_to_tensor_parallel(const at::Tensor& input, const Group& group);
at::Tensor gather_from_tensor_parallel(const at::Tensor& input, const Group& group);
// Sequence-parallel cousins, acting on dim 0 (the sequence dimension).
at::Tensor scatter_to_sequence_parallel(const at::Tensor& input, const Group& group);
at::Tensor gather_from_sequence_parallel(const at::Tensor& input, const Group& group);
at::Tensor reduce_scatter_to_sequence_parallel(const at::Tensor& input, const Group& group);

// y = x W^T + b with W sharded along its output features: W is [out/tp, in].
at::Tensor column_parallel_linear(const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, const Group& group,
                                  bool gather_output, bool sequence_parallel);
// y = x W^T + b with W sharded along its input features: W is [out, in/tp], b replicated.
at::Tensor row_parallel_linear(const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, const Group& group,
                               bool input_is_parallel, bool sequence_parallel);

}  // namespace tpcore
