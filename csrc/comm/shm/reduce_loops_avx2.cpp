// ReduceLoops built with -mavx2 -mfma -mf16c (CMake sets the flags for this file only).
#include "comm/shm/reduce_loops_impl.h"

namespace tpcore::shm {
const ReduceLoops& reduce_loops_avx2() {
  static const ReduceLoops loops{loop_f32, loop_f64, loop_bf16, loop_f16, pair_f32_streaming};
  return loops;
}
}  // namespace tpcore::shm
