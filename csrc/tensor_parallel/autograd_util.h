// Helpers shared by tpcore's C++ autograd functions.
#pragma once

#include <torch/csrc/autograd/custom_function.h>

#include <string>

#include "comm/comm.h"
#include "ops/primitives.h"

namespace tpcore {

using op::GroupName;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The group's name rides in the autograd context so backward issues its collectives on the
// same group as forward.
inline void save_group(AutogradContext* ctx, GroupName group) {
  ctx->saved_data["group"] = std::string(group);
}

inline std::string load_group(AutogradContext* ctx) {
  return ctx->saved_data["group"].toStringRef();
}

// torch.compile traces tpcore's layer ops with static shapes only: their checks and saved
// shapes read concrete sizes.
inline void check_static_shapes(const char* what, std::initializer_list<at::Tensor> tensors) {
  for (const auto& t : tensors) {
    TORCH_CHECK_NOT_IMPLEMENTED(
        !t.defined() || !t.unsafeGetTensorImpl()->has_symbolic_sizes_strides(), "tpcore: ", what,
        ": dynamic shapes are not supported; compile with torch.compile(..., dynamic=False)");
  }
}

// Whether `t` is being traced (torch.compile / export: a fake or functional tensor), not
// computed: in-place tricks on saved tensors are off then.
inline bool is_traced(const at::Tensor& t) {
  const auto keys = t.key_set();
  return keys.has(c10::DispatchKey::Python) || keys.has(c10::DispatchKey::Functionalize) ||
         t.is_meta();
}

}  // namespace tpcore
