// The loops behind SoftmaxLoops; included once per target by softmax_loops*.cpp.
// Written with GCC/Clang vector extensions of kLanes floats: SSE pairs on the baseline
// target, one AVX register with -mavx2, one AVX-512 register with TPCORE_LOOPS_AVX512.
// Everything has internal linkage.
#include <cstdint>
#include <cstring>

#if defined(__SSE__)
#include <immintrin.h>
#endif

#include "kernels/cpu/softmax_loops.h"

namespace {

#if defined(TPCORE_LOOPS_AVX512)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(float))));
constexpr float kNegInf = -__builtin_inff();

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline vf splat(float x) { return vf{} + x; }

// max(a, b) lane by lane, one instruction where there is one. Where a lane of either is
// NaN the result is b's lane (x86's MAXPS rule), so vmax(c, x) keeps a NaN x. Maxima may
// drop a NaN: the sums of exps carry it to the loss instead.
inline vf vmax(vf a, vf b) {
#if defined(TPCORE_LOOPS_AVX512)
  return (vf)_mm512_max_ps((__m512)a, (__m512)b);
#elif defined(__AVX__)
  return (vf)_mm256_max_ps((__m256)a, (__m256)b);
#else
  return a > b ? a : b;
#endif
}
inline float hmax(vf v) {
  float m = v[0];
  for (int l = 1; l < kLanes; ++l) m = (v[l] > m || v[l] != v[l]) ? v[l] : m;
  return m;
}
inline float hsum(vf v) {
  float s = 0;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

// exp(d) for d <= 0 (and up to ~80), as 2^t with t = d / ln2 = n + f, n an integer and
// |f| <= 1/2: a degree-5 polynomial for 2^f (relative error 1.3e-7, about one fp32
// rounding) times 2^n built from its exponent bits. Adding kRoundBias rounds t to an
// integer that lands in the low mantissa bits (shifted up by 23 they are the exponent
// of 2^n, biased by 127), which vectorizes without a float-to-int conversion.
// d < -86.6 gives 2^-125 (~1e-38) instead of ~0; NaN gives NaN.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kRoundBias = 12582912.0f + 127.0f;  // 1.5 * 2^23, plus the exponent bias
constexpr float kMinExpArg = -86.64f;               // t >= -125: 2^n stays a normal float

inline vf vexp(vf d) {
  d = vmax(splat(kMinExpArg), d);        // a NaN d stays NaN
  const vf j = d * kLog2e + kRoundBias;  // fused: j - kRoundBias = round(t)
  const vf n = j - kRoundBias;
  const vf f = d * kLog2e - n;  // fused, so f is exact
  // Minimax coefficients of 2^f on [-1/2, 1/2] for relative error (Lawson's algorithm).
  vf p = splat(0x1.5ac05ap-10f);
  p = p * f + 0x1.3cdd42p-7f;
  p = p * f + 0x1.c6b99cp-5f;
  p = p * f + 0x1.ebf9e0p-3f;
  p = p * f + 0x1.62e426p-1f;
  p = p * f + 1.0f;
  vi bits;
  std::memcpy(&bits, &j, sizeof(bits));
  bits <<= 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;  // a product, not an exponent add: NaN in p stays NaN
}

// Tails shorter than kLanes go through a padded vector; `fill` pads the unused lanes.
inline vf load_tail(const float* p, int64_t n, float fill) {
  vf v = splat(fill);
  for (int64_t i = 0; i < n; ++i) v[i] = p[i];
  return v;
}

float block_max(const float* x, int64_t n) {
  // Two accumulators: a max's latency, not its throughput, would bound one.
  vf m0 = splat(kNegInf), m1 = m0;
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    m0 = vmax(m0, load(x + i));
    m1 = vmax(m1, load(x + i + kLanes));
  }
  for (; i + kLanes <= n; i += kLanes) m0 = vmax(m0, load(x + i));
  if (i < n) m1 = vmax(m1, load_tail(x + i, n - i, kNegInf));
  return hmax(vmax(m0, m1));
}

float block_sum_exp(const float* x, int64_t n, float m, float* total) {
  vf se = {}, sx = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vf v = load(x + i);
    se += vexp(v - m);
    sx += v;
  }
  if (i < n) {
    // Padding lanes hold -inf (exp gives ~0) for the exps and 0 for the sum.
    const vf v = load_tail(x + i, n - i, kNegInf);
    const vf e = vexp(v - m);
    for (int64_t l = 0; l < n - i; ++l) {
      se[l] += e[l];
      sx[l] += v[l];
    }
  }
  *total += hsum(sx);
  return hsum(se);
}

void block_grad(const float* x, int64_t n, float lse, float a, float b, float* out) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(out + i, vexp(load(x + i) - lse) * a - b);
  if (i < n) {
    const vf g = vexp(load_tail(x + i, n - i, 0.0f) - lse) * a - b;
    for (int64_t l = 0; l < n - i; ++l) out[i + l] = g[l];
  }
}

// A store that bypasses the caches (no read of the line before it is written), for
// outputs far larger than the caches; `p` is aligned to the vector size.
inline void stream_store(float* p, vf v) {
#if defined(TPCORE_LOOPS_AVX512)
  _mm512_stream_ps(p, (__m512)v);
#elif defined(__AVX__)
  _mm256_stream_ps(p, (__m256)v);
#elif defined(__SSE__)
  __m128 half[2];
  std::memcpy(half, &v, sizeof(v));
  _mm_stream_ps(p, half[0]);
  _mm_stream_ps(p + 4, half[1]);
#else
  store(p, v);
#endif
}

void block_grad_stream(const float* x, int64_t n, float lse, float a, float b, float* out) {
  // Plain stores up to the first aligned address, streaming ones from there.
  constexpr uintptr_t kAlign = sizeof(vf);
  int64_t i = static_cast<int64_t>((kAlign - reinterpret_cast<uintptr_t>(out) % kAlign) % kAlign /
                                   sizeof(float));
  if (i >= n) return block_grad(x, n, lse, a, b, out);
  block_grad(x, i, lse, a, b, out);
  for (; i + kLanes <= n; i += kLanes) stream_store(out + i, vexp(load(x + i) - lse) * a - b);
  block_grad(x + i, n - i, lse, a, b, out + i);
}

// bfloat16 <-> float on blocks (bf16 is the top half of a float's bits).
typedef uint16_t vh __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t vu __attribute__((vector_size(kLanes * sizeof(uint32_t))));

void widen_bf16(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    vh h;
    std::memcpy(&h, src + i, sizeof(h));
    const vu u = __builtin_convertvector(h, vu) << 16;
    std::memcpy(dst + i, &u, sizeof(u));
  }
  for (; i < n; ++i) {
    const uint32_t u = uint32_t(src[i]) << 16;
    std::memcpy(dst + i, &u, sizeof(u));
  }
}

// Rounds to nearest even, a NaN to 0x7FC0: bit for bit what c10::BFloat16(float) does.
inline uint32_t round_bf16(uint32_t u) { return (u + (((u >> 16) & 1) + 0x7FFF)) >> 16; }

void narrow_bf16(const float* src, int64_t n, uint16_t* dst) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vf f = load(src + i);
    vu u;
    std::memcpy(&u, &f, sizeof(u));
    const vu nan = (vu)(f != f);
    const vu r = (((u + (((u >> 16) & 1) + 0x7FFF)) >> 16) & ~nan) | (nan & 0x7FC0);
    const vh h = __builtin_convertvector(r, vh);
    std::memcpy(dst + i, &h, sizeof(h));
  }
  for (; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, src + i, sizeof(u));
    dst[i] = static_cast<uint16_t>(src[i] != src[i] ? 0x7FC0 : round_bf16(u));
  }
}

void stream_fence() {
#if defined(__SSE__)
  _mm_sfence();
#endif
}

}  // namespace
