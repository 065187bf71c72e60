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

// Shapes may be symbolic where the layer ops are traced with dynamic shapes
// (torch.compile(dynamic=True), or dynamo's automatic dynamic shapes): the ops read sizes
// through sym_size / sym_sizes, and a check on them guards the compiled graph.
inline bool holds(bool condition) { return condition; }
inline bool holds(const c10::SymBool& condition) {
  return condition.guard_bool(__FILE__, __LINE__);
}
// A size an op needs as a plain int (a vocabulary size): specialised, where traced.
inline int64_t concrete(const c10::SymInt& size) { return size.guard_int(__FILE__, __LINE__); }
inline bool same_shape(c10::SymIntArrayRef a, c10::SymIntArrayRef b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!holds(a[i] == b[i])) return false;
  }
  return true;
}
// [..., last] -> [tokens, last]: the GEMMs' and kernels' 2-D view.
inline at::Tensor as_2d(const at::Tensor& t) {
  return t.reshape_symint({c10::SymInt(-1), t.sym_size(-1)});
}

// Whether `t` is being traced (torch.compile / export: a fake or functional tensor), not
// computed: in-place tricks on saved tensors are off then.
inline bool is_traced(const at::Tensor& t) {
  const auto keys = t.key_set();
  return keys.has(c10::DispatchKey::Python) || keys.has(c10::DispatchKey::Functionalize) ||
         t.is_meta();
}

}  // namespace tpcore
