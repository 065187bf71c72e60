// CPU kernels of the vocab-parallel cross-entropy.
//
// The forward is one pass over each row of logits (online softmax by blocks: a
// block's max, then its exps against the running max, rescaling the running sum
// when the max grows). The backward is one read and one write per element. The
// inner loops (softmax_loops.h) are SIMD, built for AVX2+FMA where the CPU has it.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/softmax_loops.h"
#include "kernels/kernels.h"

namespace tpcore {
namespace {

constexpr int64_t kBlock = 512;  // floats per block: stays in L1 between the two block passes
// fp32 gradients at least this large are written with streaming stores: they cannot stay in
// the caches anyway, and such stores skip reading each line before writing it.
constexpr int64_t kStreamBytes = int64_t(32) << 20;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Rows of type T are handled in float blocks: float rows are used in place, others
// are converted block by block into a small buffer.
template <typename T>
const float* as_float(const T* src, int64_t n, float* buffer, const SoftmaxLoops& loops) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    loops.widen_bf16(reinterpret_cast<const uint16_t*>(src), n, buffer);
    return buffer;
  } else {
    for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(src[i]);
    return buffer;
  }
}

// Rounds a float block into row `dst` of type T (not float), once.
template <typename T>
void store_rounded(const float* src, int64_t n, T* dst, const SoftmaxLoops& loops) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    loops.narrow_bf16(src, n, reinterpret_cast<uint16_t*>(dst));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
  }
}

template <typename T>
void stats_rows(const at::Tensor& logits, const int64_t* target, int64_t vocab_start, int64_t valid,
                float* stats) {
  const int64_t rows = logits.size(0), stride = logits.size(1);
  const T* base = logits.data_ptr<T>();
  const SoftmaxLoops& loops = softmax_loops();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    float buffer[kBlock];
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = base + r * stride;
      float m = kNegInf, s = 0, total = 0;
      for (int64_t j = 0; j < valid; j += kBlock) {
        const int64_t n = std::min(kBlock, valid - j);
        const float* x = as_float(row + j, n, buffer, loops);
        const float bm = loops.block_max(x, n);
        if (bm > m || std::isnan(bm)) {  // a NaN max sticks: the row's loss is NaN
          s = (m == kNegInf) ? 0.0f : s * std::exp(m - bm);
          m = bm;
        }
        if (m != kNegInf) {
          s += loops.block_sum_exp(x, n, m, &total);
        } else {
          total += kNegInf;  // every logit so far is -inf: they add nothing to s, -inf to the sum
        }
      }
      const int64_t local = target[r] - vocab_start;
      float* out = stats + r * 4;
      out[0] = m;
      out[1] = s;
      out[2] = (local >= 0 && local < valid) ? static_cast<float>(row[local]) : 0.0f;
      out[3] = total;
    }
  });
}

template <typename T>
void grad_rows(const at::Tensor& logits, const int64_t* target, const float* lse,
               const float* scale, at::Tensor& out, int64_t vocab_start, int64_t valid,
               int64_t vocab, float smoothing, float z_loss) {
  const int64_t rows = logits.size(0), stride = logits.size(1);
  const T* base = logits.data_ptr<T>();
  T* out_base = out.data_ptr<T>();
  const SoftmaxLoops& loops = softmax_loops();
  // Not in place: there the lines were just read and are in the cache already.
  const bool stream = std::is_same_v<T, float> && out.data_ptr() != logits.data_ptr() &&
                      out.nbytes() >= kStreamBytes;
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    float in_buf[kBlock], out_buf[kBlock];
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = base + r * stride;
      T* grad = out_base + r * stride;
      const float g = scale[r];
      const float a = g * (1.0f + 2.0f * z_loss * lse[r]);
      const float b = g * smoothing / static_cast<float>(vocab);
      const int64_t local = target[r] - vocab_start;
      // Each block is read before it is written: `out` may alias `logits`.
      for (int64_t j = 0; j < valid; j += kBlock) {
        const int64_t n = std::min(kBlock, valid - j);
        const float* x = as_float(row + j, n, in_buf, loops);
        float* g_out = std::is_same_v<T, float> ? reinterpret_cast<float*>(grad + j) : out_buf;
        const bool has_target = local >= j && local < j + n;
        // The target's block is read back below: keep it in the cache.
        (stream && !has_target ? loops.block_grad_stream : loops.block_grad)(x, n, lse[r], a, b,
                                                                             g_out);
        // The target's p - 1 is formed in fp32 and rounded once: near p = 1 a rounded p
        // would cancel to 0.
        if (has_target) g_out[local - j] -= g * (1.0f - smoothing);
        if constexpr (!std::is_same_v<T, float>) store_rounded(out_buf, n, grad + j, loops);
      }
      std::fill(grad + valid, grad + stride, static_cast<T>(0));
    }
    if (stream) loops.stream_fence();  // before another thread reads the gradient
  });
}

}  // namespace

at::Tensor cross_entropy_stats_cpu(const at::Tensor& logits, const at::Tensor& target,
                                   int64_t vocab_start, int64_t valid) {
  at::Tensor stats = at::empty({logits.size(0), 4}, logits.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "ce_stats", [&] {
    stats_rows<scalar_t>(logits, target.data_ptr<int64_t>(), vocab_start, valid,
                         stats.data_ptr<float>());
  });
  return stats;
}

void cross_entropy_grad_cpu(const at::Tensor& logits, const at::Tensor& target,
                            const at::Tensor& lse, const at::Tensor& scale, at::Tensor& out,
                            int64_t vocab_start, int64_t valid, int64_t vocab, double smoothing,
                            double z_loss) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "ce_grad", [&] {
    grad_rows<scalar_t>(logits, target.data_ptr<int64_t>(), lse.data_ptr<float>(),
                        scale.data_ptr<float>(), out, vocab_start, valid, vocab,
                        static_cast<float>(smoothing), static_cast<float>(z_loss));
  });
}

}  // namespace tpcore
