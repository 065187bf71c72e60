// The floating-point loops behind ReduceLoops; included once per instruction set by
// reduce_loops*.cpp. Plain loops over blocks that GCC and Clang vectorize (-O3); the
// accumulator block stays in L1. Everything has internal linkage.
#include <cstdint>
#include <cstring>

#include "comm/shm/reduce_loops.h"

namespace {

using tpcore::shm::ReduceKind;

constexpr int64_t kBlock = 512;

template <class Acc>
inline Acc combine(Acc a, Acc b, ReduceKind k) {
  switch (k) {
    case ReduceKind::kSum:
    case ReduceKind::kAvg:
      return a + b;
    case ReduceKind::kProduct:
      return a * b;
    case ReduceKind::kMax:  // NaN wins, as in torch.maximum
      return (a != a) ? a : ((b != b) ? b : (a > b ? a : b));
    case ReduceKind::kMin:
      return (a != a) ? a : ((b != b) ? b : (a < b ? a : b));
  }
  return a;
}

// One block: acc = load(src0), acc = acc (op) load(src_s) for s in order, then store.
template <class T, class Acc, class Load, class Store>
inline void reduce_blocks(T* out, const T* const* srcs, int nsrc, int64_t n, ReduceKind k,
                          Load load, Store store) {
  Acc acc[kBlock];
  const Acc inv = Acc(1) / Acc(nsrc);
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t m = n - i0 < kBlock ? n - i0 : kBlock;
    const T* s0 = srcs[0] + i0;
    for (int64_t j = 0; j < m; ++j) acc[j] = load(s0[j]);
    for (int s = 1; s < nsrc; ++s) {
      const T* src = srcs[s] + i0;
      // Separate loops per kind so each vectorizes without a switch inside.
      switch (k) {
        case ReduceKind::kSum:
        case ReduceKind::kAvg:
          for (int64_t j = 0; j < m; ++j) acc[j] = acc[j] + load(src[j]);
          break;
        case ReduceKind::kProduct:
          for (int64_t j = 0; j < m; ++j) acc[j] = acc[j] * load(src[j]);
          break;
        default:
          for (int64_t j = 0; j < m; ++j) acc[j] = combine<Acc>(acc[j], load(src[j]), k);
      }
    }
    if (k == ReduceKind::kAvg)
      for (int64_t j = 0; j < m; ++j) acc[j] = acc[j] * inv;
    T* o = out + i0;
    for (int64_t j = 0; j < m; ++j) o[j] = store(acc[j]);
  }
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even; NaN stays a (quiet) NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + (((u >> 16) & 1) + 0x7FFF)) >> 16;
  return f != f ? uint16_t(0x7FC0) : uint16_t(rounded);
}

inline float f16_to_float(uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return static_cast<float>(x);
}

inline uint16_t float_to_f16(float f) {
  const _Float16 x = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &x, 2);
  return h;
}

void loop_f32(float* out, const float* const* srcs, int nsrc, int64_t n, ReduceKind k) {
  reduce_blocks<float, float>(
      out, srcs, nsrc, n, k, [](float x) { return x; }, [](float x) { return x; });
}

void loop_f64(double* out, const double* const* srcs, int nsrc, int64_t n, ReduceKind k) {
  reduce_blocks<double, double>(
      out, srcs, nsrc, n, k, [](double x) { return x; }, [](double x) { return x; });
}

void loop_bf16(uint16_t* out, const uint16_t* const* srcs, int nsrc, int64_t n, ReduceKind k) {
  reduce_blocks<uint16_t, float>(out, srcs, nsrc, n, k, bf16_to_float, float_to_bf16);
}

void loop_f16(uint16_t* out, const uint16_t* const* srcs, int nsrc, int64_t n, ReduceKind k) {
  reduce_blocks<uint16_t, float>(out, srcs, nsrc, n, k, f16_to_float, float_to_f16);
}

}  // namespace
