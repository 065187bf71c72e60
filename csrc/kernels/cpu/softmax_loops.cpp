// SoftmaxLoops for the baseline target, and the run-time choice between the builds.
#include "kernels/cpu/softmax_loops_impl.h"

namespace tpcore {

#ifdef TPCORE_HAVE_AVX2_LOOPS
const SoftmaxLoops& softmax_loops_avx2();
#endif

const SoftmaxLoops& softmax_loops() {
  static const SoftmaxLoops baseline{block_max,    block_sum_exp, block_grad, block_grad_stream,
                                     stream_fence, widen_bf16,    narrow_bf16};
#ifdef TPCORE_HAVE_AVX2_LOOPS
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) return softmax_loops_avx2();
#endif
  return baseline;
}

}  // namespace tpcore
