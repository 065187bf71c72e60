// Element-wise reductions of equally long buffers, in a fixed order (source 0 first), so
// every rank that reduces the same buffers gets the same bits. bfloat16 and float16 are
// accumulated in float32 and rounded once; integers wrap like two's complement.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace tpcore::shm {

enum class ReduceKind : uint8_t { kSum, kAvg, kMax, kMin, kProduct };

// Whether reduce() handles `dtype` with `kind` (kAvg: floating types only).
bool reducible(at::ScalarType dtype, ReduceKind kind);

// out[i] = srcs[0][i] (op) srcs[1][i] (op) ... for i < n; kAvg divides the sum by nsrc.
// `out` may be one of the sources (the same address: every block is loaded from all sources
// before it is stored), never a partial overlap. `stream`: write `out` with streaming stores
// where a loop for it exists (float32 sum or average of two sources, AVX2), plain stores
// otherwise; the caller fences (stream_store.h). The bits are the same either way.
void reduce(void* out, const void* const* srcs, int nsrc, int64_t n, at::ScalarType dtype,
            ReduceKind kind, bool stream = false);

// The typed loops, one table per instruction set (baseline and AVX2+F16C), picked at run time.
struct ReduceLoops {
  void (*f32)(float*, const float* const*, int, int64_t, ReduceKind);
  void (*f64)(double*, const double* const*, int, int64_t, ReduceKind);
  void (*bf16)(uint16_t*, const uint16_t* const*, int, int64_t, ReduceKind);
  void (*f16)(uint16_t*, const uint16_t* const*, int, int64_t, ReduceKind);
  // out = a + b (times inv when averaging) with streaming stores; null where not built.
  void (*f32_pair_streaming)(float* out, const float* a, const float* b, int64_t n, bool average,
                             float inv) = nullptr;
};

}  // namespace tpcore::shm
