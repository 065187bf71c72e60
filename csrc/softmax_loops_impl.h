// The loops behind SoftmaxLoops; included once per target by softmax_loops*.cpp.
// Written with GCC/Clang vector extensions (8 floats): SSE pairs on the baseline
// target, one AVX register with -mavx2. Everything has internal linkage.
#include <cstdint>
#include <cstring>

#include "softmax_loops.h"

namespace {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
constexpr int kLanes = 8;
constexpr float kNegInf = -__builtin_inff();

inline v8f load(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }
inline v8f splat(float x) { return v8f{} + x; }
// Maxima that propagate NaN (as torch.max does): a NaN logit must make the loss NaN.
inline v8f vmax(v8f a, v8f b) { return (a > b) | (a != a) ? a : b; }
inline float hmax(v8f v) {
  float m = v[0];
  for (int l = 1; l < kLanes; ++l) m = (v[l] > m || v[l] != v[l]) ? v[l] : m;
  return m;
}
inline float hsum(v8f v) {
  float s = 0;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

// exp(x) for x <= ~0: 2^n * 2^f with n = round(x / ln2), |f| <= ln2 / 2, and a
// degree-7 polynomial for e^f (relative error < 1e-8 before rounding). Rounding uses
// the 1.5 * 2^23 trick so that it vectorizes; inputs below -87 give ~0; NaN stays NaN.
inline v8f vexp(v8f x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  const v8f t = x * 1.44269504088896341f;
  const v8f n = (t + 12582912.0f) - 12582912.0f;
  const v8f f = (t - n) * 0.693147180559945309f;
  v8f p = splat(1.0f / 5040);
  p = p * f + 1.0f / 720;
  p = p * f + 1.0f / 120;
  p = p * f + 1.0f / 24;
  p = p * f + 1.0f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8f scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Tails shorter than 8 go through a padded vector; `fill` pads the unused lanes.
inline v8f load_tail(const float* p, int64_t n, float fill) {
  v8f v = splat(fill);
  for (int64_t i = 0; i < n; ++i) v[i] = p[i];
  return v;
}

float block_max(const float* x, int64_t n) {
  v8f m = splat(kNegInf);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) m = vmax(m, load(x + i));
  if (i < n) m = vmax(m, load_tail(x + i, n - i, kNegInf));
  return hmax(m);
}

float block_sum_exp(const float* x, int64_t n, float m, float* total) {
  v8f se = {}, sx = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const v8f v = load(x + i);
    se += vexp(v - m);
    sx += v;
  }
  if (i < n) {
    // Padding lanes hold -inf (exp gives ~0) for the exps and 0 for the sum.
    const v8f v = load_tail(x + i, n - i, kNegInf);
    const v8f e = vexp(v - m);
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
    const v8f g = vexp(load_tail(x + i, n - i, 0.0f) - lse) * a - b;
    for (int64_t l = 0; l < n - i; ++l) out[i + l] = g[l];
  }
}

}  // namespace
