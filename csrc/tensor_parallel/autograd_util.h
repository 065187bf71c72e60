// Helpers shared by tpcore's C++ autograd functions.
#pragma once

#include <torch/csrc/autograd/custom_function.h>

#include "comm/comm.h"

namespace tpcore {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The group rides in the autograd context as a capsule so backward issues its
// collectives on the same group as forward.
inline void save_group(AutogradContext* ctx, const Group& group) {
  ctx->saved_data["group"] = c10::IValue::make_capsule(group);
}

inline Group load_group(AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<c10d::ProcessGroup>(
      ctx->saved_data["group"].toCapsule());
}

}  // namespace tpcore
