// Inner loops of the CPU cross-entropy kernels on float blocks, built twice: for the
// baseline x86-64 (or any) target and for AVX2+FMA, picked once at run time. The
// loop translation units include no ATen headers, so no inline function compiled for
// AVX2 can leak into code that runs on CPUs without it.
#pragma once

#include <cstdint>

namespace tpcore {

struct SoftmaxLoops {
  // max(x[0..n))
  float (*block_max)(const float* x, int64_t n);
  // Returns sum exp(x - m) and adds sum x to *total.
  float (*block_sum_exp)(const float* x, int64_t n, float m, float* total);
  // out = exp(x - lse) * a - b
  void (*block_grad)(const float* x, int64_t n, float lse, float a, float b, float* out);
  // The same with non-temporal stores where `out` allows (aligned lanes); for outputs
  // much larger than the caches. Call stream_fence() before others read them.
  void (*block_grad_stream)(const float* x, int64_t n, float lse, float a, float b, float* out);
  void (*stream_fence)();
  // bfloat16 (as raw bits) to float, and back with rounding to nearest even as c10 does.
  void (*widen_bf16)(const uint16_t* src, int64_t n, float* dst);
  void (*narrow_bf16)(const float* src, int64_t n, uint16_t* dst);
};

// The fastest variant this CPU supports.
const SoftmaxLoops& softmax_loops();

}  // namespace tpcore
