// The baseline Philox words loop, and the run-time choice between the builds.
#include "kernels/cpu/philox_words.h"

#include "kernels/philox.h"

namespace tpcore {

#ifdef TPCORE_HAVE_AVX2_LOOPS
void philox_words_avx2(uint64_t key, uint64_t first, int64_t blocks, uint32_t* out);
#endif

PhiloxWordsFn philox_words() {
#ifdef TPCORE_HAVE_AVX2_LOOPS
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return philox_words_avx2;
#endif
  return dropout_words;
}

}  // namespace tpcore
