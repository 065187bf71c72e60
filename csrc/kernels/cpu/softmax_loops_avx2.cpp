// SoftmaxLoops built with -mavx2 -mfma (CMake sets the flags for this file only).
#include "kernels/cpu/softmax_loops_impl.h"

namespace tpcore {
const SoftmaxLoops& softmax_loops_avx2() {
  static const SoftmaxLoops loops{block_max,    block_sum_exp, block_grad, block_grad_stream,
                                  stream_fence, widen_bf16,    narrow_bf16};
  return loops;
}
}  // namespace tpcore
