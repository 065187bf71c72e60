// The floating-point loops behind ReduceLoops; included once per instruction set by
// reduce_loops*.cpp. Plain loops over blocks that GCC and Clang vectorize (-O3); the
// accumulator block stays in L1. The one exception, written with intrinsics because
// compilers do not emit streaming stores, is the AVX2 build's pair_f32_streaming at the end.
// Everything has internal linkage.
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

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

// acc = acc (op) load(src_s) for the sources [from, to), in order.
template <class T, class Acc, class Load, class Op>
inline void fold(Acc* acc, const T* const* srcs, int from, int to, int64_t i0, int64_t m, Load load,
                 Op op) {
  for (int s = from; s < to; ++s) {
    const T* src = srcs[s] + i0;
    for (int64_t j = 0; j < m; ++j) acc[j] = op(acc[j], load(src[j]));
  }
}

// o = store(post(load_a(a) (op) load(b))) in one pass. `restrict`: the caller guarantees o
// overlaps neither source, so the loop vectorizes without run-time overlap checks.
template <class T, class A, class LoadA, class Load, class Store, class Op, class Post>
inline void combine_into(T* __restrict o, const A* __restrict a, const T* __restrict b, int64_t m,
                         LoadA load_a, Load load, Store store, Op op, Post post) {
  for (int64_t j = 0; j < m; ++j) o[j] = store(post(op(load_a(a[j]), load(b[j]))));
}

// Block by block: out = store(post(load(src_0) (op) load(src_1) (op) ...)) in source order,
// the last source combined in the pass that writes the output (with two sources, no
// accumulator at all): reading the sources and writing the output in one pass made a
// 2-rank 16 MiB all-reduce about 35% faster here than loading source 0 alone first. When
// `out` is one of the sources, every source of a block is read before the block is
// written. Both ways do the same arithmetic in the same order: the bits do not depend on
// the path.
template <class T, class Acc, class Load, class Store, class Op, class Post>
inline void reduce_with(T* out, const T* const* srcs, int nsrc, int64_t n, Load load, Store store,
                        Op op, Post post) {
  bool out_is_source = false;
  for (int s = 0; s < nsrc; ++s) out_is_source = out_is_source || srcs[s] == out;
  auto same = [](Acc x) { return x; };
  Acc acc[kBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t m = n - i0 < kBlock ? n - i0 : kBlock;
    const T* s0 = srcs[0] + i0;
    T* o = out + i0;
    if (nsrc == 1) {
      for (int64_t j = 0; j < m; ++j) acc[j] = load(s0[j]);
    } else {
      const T* s1 = srcs[1] + i0;
      if (nsrc == 2 && !out_is_source) {
        combine_into(o, s0, s1, m, load, load, store, op, post);
        continue;
      }
      for (int64_t j = 0; j < m; ++j) acc[j] = op(load(s0[j]), load(s1[j]));
      if (!out_is_source) {
        fold<T, Acc>(acc, srcs, 2, nsrc - 1, i0, m, load, op);
        combine_into(o, acc, srcs[nsrc - 1] + i0, m, same, load, store, op, post);
        continue;
      }
      fold<T, Acc>(acc, srcs, 2, nsrc, i0, m, load, op);
    }
    for (int64_t j = 0; j < m; ++j) o[j] = store(post(acc[j]));
  }
}

// Separate instantiations per kind so each loop vectorizes without a switch inside.
template <class T, class Acc, class Load, class Store>
inline void reduce_blocks(T* out, const T* const* srcs, int nsrc, int64_t n, ReduceKind k,
                          Load load, Store store) {
  auto same = [](Acc x) { return x; };
  switch (k) {
    case ReduceKind::kSum:
      return reduce_with<T, Acc>(
          out, srcs, nsrc, n, load, store, [](Acc a, Acc b) { return a + b; }, same);
    case ReduceKind::kAvg: {
      const Acc inv = Acc(1) / Acc(nsrc);
      return reduce_with<T, Acc>(
          out, srcs, nsrc, n, load, store, [](Acc a, Acc b) { return a + b; },
          [inv](Acc x) { return x * inv; });
    }
    case ReduceKind::kProduct:
      return reduce_with<T, Acc>(
          out, srcs, nsrc, n, load, store, [](Acc a, Acc b) { return a * b; }, same);
    case ReduceKind::kMax:
      return reduce_with<T, Acc>(
          out, srcs, nsrc, n, load, store,
          [](Acc a, Acc b) { return combine<Acc>(a, b, ReduceKind::kMax); }, same);
    case ReduceKind::kMin:
      return reduce_with<T, Acc>(
          out, srcs, nsrc, n, load, store,
          [](Acc a, Acc b) { return combine<Acc>(a, b, ReduceKind::kMin); }, same);
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

#if defined(__AVX2__)
// out = a + b (times `inv` when averaging), float32, with streaming stores 8 lanes at a time
// (plain stores up to the first 32-byte-aligned element and after the last whole vector).
// The same operations as the plain loops, so the same bits. `out` overlaps neither source.
void pair_f32_streaming(float* out, const float* a, const float* b, int64_t n, bool average,
                        float inv) {
  int64_t j = 0;
  auto one = [&](int64_t i) {
    const float s = a[i] + b[i];
    out[i] = average ? s * inv : s;
  };
  for (; j < n && reinterpret_cast<uintptr_t>(out + j) % 32 != 0; ++j) one(j);
  const __m256 vinv = _mm256_set1_ps(inv);
  for (; j + 8 <= n; j += 8) {
    __m256 s = _mm256_add_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j));
    if (average) s = _mm256_mul_ps(s, vinv);
    _mm256_stream_ps(out + j, s);
  }
  for (; j < n; ++j) one(j);
}
#endif

}  // namespace
