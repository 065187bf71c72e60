// torch.autocast support shared by the layers and the losses: under autocast they compute
// as nn.Linear and F.cross_entropy do (linear in the autocast dtype, the loss in fp32).
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <optional>

namespace tpcore {

// The autocast dtype where autocast is on for `like`'s device (CPU or CUDA), else nullopt.
inline std::optional<at::ScalarType> autocast_dtype(const at::Tensor& like) {
  const c10::DeviceType type = like.device().type();
  if (type != c10::DeviceType::CPU && type != c10::DeviceType::CUDA) return std::nullopt;
  if (!at::autocast::is_autocast_enabled(type)) return std::nullopt;
  return at::autocast::get_autocast_dtype(type);
}

// A tensor cast to the autocast dtype the way autocast casts a linear's inputs: a
// differentiable cast (gradients reach fp32 weights in fp32), cached for leaf weights.
inline at::Tensor autocast_input(const at::Tensor& t, at::ScalarType dtype) {
  return at::autocast::cached_cast(dtype, t, t.device().type());
}

// Inside tpcore's functions every dtype is chosen explicitly: autocast stays out of them.
struct NoAutocast : c10::impl::ExcludeDispatchKeyGuard {
  NoAutocast() : ExcludeDispatchKeyGuard(c10::autocast_dispatch_keyset) {}
};

}  // namespace tpcore
