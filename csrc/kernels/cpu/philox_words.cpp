// The baseline Philox words loop, and the run-time choice between the builds.
#include "kernels/cpu/philox_words.h"

#include "kernels/philox.h"

namespace tpcore {

#ifdef TPCORE_HAVE_AVX2_LOOPS
void philox_words_avx2(uint64_t key, uint64_t first, int64_t blocks, uint32_t* out);
#endif

namespace {

void philox_words_scalar(uint64_t key, uint64_t first, int64_t blocks, uint32_t* out) {
  for (int64_t b = 0; b < blocks; ++b) {
    const Philox4 r = dropout_block(key, first + static_cast<uint64_t>(b));
    for (int l = 0; l < 4; ++l) out[4 * b + l] = r.v[l];
  }
}

}  // namespace

PhiloxWordsFn philox_words() {
#ifdef TPCORE_HAVE_AVX2_LOOPS
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return philox_words_avx2;
#endif
  return philox_words_scalar;
}

}  // namespace tpcore
