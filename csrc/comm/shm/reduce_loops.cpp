// Baseline ReduceLoops, the run-time choice of instruction set, and the integer loops.
#include <c10/util/Exception.h>

#include <type_traits>

#include "comm/shm/reduce_loops_impl.h"

namespace tpcore::shm {

#ifdef TPCORE_HAVE_AVX2_LOOPS
const ReduceLoops& reduce_loops_avx2();
#endif

namespace {

const ReduceLoops& loops() {
  static const ReduceLoops baseline{loop_f32, loop_f64, loop_bf16, loop_f16};
#ifdef TPCORE_HAVE_AVX2_LOOPS
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  if (avx2) return reduce_loops_avx2();
#endif
  return baseline;
}

// Integers: sums and products in the unsigned type, so overflow wraps without UB.
template <class T>
void int_loop(void* out, const void* const* srcs, int nsrc, int64_t n, ReduceKind k) {
  using U = std::make_unsigned_t<T>;
  // Reduce the unsigned view for sums and products; max/min need the signed order.
  if (k == ReduceKind::kSum || k == ReduceKind::kProduct) {
    reduce_blocks<U, U>(
        static_cast<U*>(out), reinterpret_cast<const U* const*>(srcs), nsrc, n, k,
        [](U x) { return x; }, [](U x) { return x; });
  } else {
    reduce_blocks<T, T>(
        static_cast<T*>(out), reinterpret_cast<const T* const*>(srcs), nsrc, n, k,
        [](T x) { return x; }, [](T x) { return x; });
  }
}

}  // namespace

bool reducible(at::ScalarType dtype, ReduceKind kind) {
  switch (dtype) {
    case at::kFloat:
    case at::kDouble:
    case at::kBFloat16:
    case at::kHalf:
      return true;
    case at::kChar:
    case at::kByte:
    case at::kShort:
    case at::kInt:
    case at::kLong:
      return kind != ReduceKind::kAvg;
    default:
      return false;
  }
}

void reduce(void* out, const void* const* srcs, int nsrc, int64_t n, at::ScalarType dtype,
            ReduceKind kind, bool stream) {
  const ReduceLoops& l = loops();
  if (stream && l.f32_pair_streaming && dtype == at::kFloat && nsrc == 2 &&
      (kind == ReduceKind::kSum || kind == ReduceKind::kAvg) && srcs[0] != out && srcs[1] != out)
    return l.f32_pair_streaming(static_cast<float*>(out), static_cast<const float*>(srcs[0]),
                                static_cast<const float*>(srcs[1]), n, kind == ReduceKind::kAvg,
                                1.0f / 2);
  switch (dtype) {
    case at::kFloat:
      return l.f32(static_cast<float*>(out), reinterpret_cast<const float* const*>(srcs), nsrc, n,
                   kind);
    case at::kDouble:
      return l.f64(static_cast<double*>(out), reinterpret_cast<const double* const*>(srcs), nsrc, n,
                   kind);
    case at::kBFloat16:
      return l.bf16(static_cast<uint16_t*>(out), reinterpret_cast<const uint16_t* const*>(srcs),
                    nsrc, n, kind);
    case at::kHalf:
      return l.f16(static_cast<uint16_t*>(out), reinterpret_cast<const uint16_t* const*>(srcs),
                   nsrc, n, kind);
    case at::kChar:
      return int_loop<int8_t>(out, srcs, nsrc, n, kind);
    case at::kByte:
      return int_loop<uint8_t>(out, srcs, nsrc, n, kind);
    case at::kShort:
      return int_loop<int16_t>(out, srcs, nsrc, n, kind);
    case at::kInt:
      return int_loop<int32_t>(out, srcs, nsrc, n, kind);
    case at::kLong:
      return int_loop<int64_t>(out, srcs, nsrc, n, kind);
    default:
      TORCH_CHECK(false, "tpcore shm: cannot reduce dtype ", dtype);
  }
}

}  // namespace tpcore::shm
