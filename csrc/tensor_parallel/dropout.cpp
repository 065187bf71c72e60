// Dropout whose mask is a pure function of (seed, offset): the primitive `dropout_apply`
// (a kernel per device) and the autograd op `dropout`, whose backward applies the same mask
// to the gradient by calling the primitive again with the same state. Nothing is drawn from
// torch's generators, so torch.compile traces it, recompute replays it, and every device gives
// the same mask. The caller (tpcore.tensor_parallel.random) owns the (seed, offset) streams.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "kernels/kernels.h"
#include "tensor_parallel/autograd_util.h"
#include "tensor_parallel/functions.h"

namespace tpcore {
namespace {

void check_dropout_args(const at::Tensor& input, const at::Tensor& rng_state, double p) {
  TORCH_CHECK_VALUE(p >= 0.0 && p < 1.0, "tpcore: dropout: p must be in [0, 1), got ", p);
  TORCH_CHECK_TYPE(at::isFloatingType(input.scalar_type()),
                   "tpcore: dropout: input must be a floating-point tensor, got ",
                   input.scalar_type());
  TORCH_CHECK_VALUE(rng_state.scalar_type() == at::kLong && rng_state.dim() == 1 &&
                        holds(rng_state.sym_numel() == 2),
                    "tpcore: dropout: rng_state must be an int64 tensor [2] holding (seed, "
                    "offset), got ",
                    rng_state.scalar_type(), " of shape ", rng_state.sym_sizes());
  TORCH_CHECK_VALUE(rng_state.device() == input.device(), "tpcore: dropout: rng_state is on ",
                    rng_state.device(), " but the input is on ", input.device());
}

// Kept when the element's 32-bit word is >= p * 2^32.
uint32_t keep_threshold(double p) {
  return static_cast<uint32_t>(std::min(std::llround(std::ldexp(p, 32)), 0xFFFFFFFFLL));
}

struct Dropout : public torch::autograd::Function<Dropout> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& rng_state, double p) {
    ctx->save_for_backward({rng_state});
    ctx->saved_data["p"] = p;
    return op::dropout_apply(input, rng_state, p);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // d(x * m * scale)/dx = m * scale: the same mask, drawn again from the same state.
    const at::Tensor rng_state = ctx->get_saved_variables()[0];
    at::Tensor grad = grads[0].defined()
                          ? op::dropout_apply(grads[0], rng_state, ctx->saved_data["p"].toDouble())
                          : at::Tensor();
    return {grad, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor dropout_apply_kernel(const at::Tensor& input, const at::Tensor& rng_state, double p) {
  check_dropout_args(input, rng_state, p);
  const uint32_t threshold = keep_threshold(p);
  const double scale = 1.0 / (1.0 - p);
#ifdef TPCORE_WITH_CUDA
  if (input.is_cuda()) return dropout_cuda(input, rng_state, threshold, scale);
#endif
  TORCH_CHECK(input.is_cpu(), "tpcore: dropout: no kernel for device ", input.device());
  const int64_t* state = rng_state.const_data_ptr<int64_t>();
  TORCH_CHECK_VALUE(state[1] >= 0 && state[1] % 4 == 0,
                    "tpcore: dropout: the offset in rng_state must be a non-negative multiple of "
                    "4, got ",
                    state[1]);
  return dropout_cpu(input, static_cast<uint64_t>(state[0]), static_cast<uint64_t>(state[1]),
                     threshold, scale);
}

at::Tensor rng_state_copy_kernel(const at::Tensor& counter) { return counter.clone(); }

at::Tensor dropout(const at::Tensor& input, const at::Tensor& rng_state, double p) {
  // The arguments are checked where the mask is applied: dropout_apply's kernel, or its
  // fake kernel when traced.
  return Dropout::apply(input, rng_state, p);
}

}  // namespace tpcore
