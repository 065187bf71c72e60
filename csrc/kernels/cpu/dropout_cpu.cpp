// CPU kernel of the counter-based dropout (kernels/philox.h): out = x * (keep ? scale : 0).
// Threads take whole chunks; each chunk's Philox words come from the vectorized loop
// (kernels/cpu/philox_words.h), then one pass applies them.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>

#include "kernels/cpu/philox_words.h"
#include "kernels/kernels.h"

namespace tpcore {
namespace {

constexpr int64_t kChunkBlocks = 256;  // 1024 elements: 4 KiB of words, in L1

template <typename scalar_t>
void dropout_chunks(const scalar_t* in, scalar_t* out, int64_t n, uint64_t seed, uint64_t first,
                    uint32_t threshold, double scale) {
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t kept = static_cast<acc_t>(scale);
  const PhiloxWordsFn words_of = philox_words();
  const int64_t blocks = (n + 3) / 4, chunks = (blocks + kChunkBlocks - 1) / kChunkBlocks;
  at::parallel_for(0, chunks, 16, [&](int64_t c0, int64_t c1) {
    uint32_t words[4 * kChunkBlocks];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b0 = c * kChunkBlocks, nb = std::min(kChunkBlocks, blocks - b0);
      words_of(seed, first + static_cast<uint64_t>(b0), nb, words);
      const int64_t base = 4 * b0, len = std::min(4 * nb, n - base);
      for (int64_t i = 0; i < len; ++i) {
        // A multiply, not a select: a NaN stays NaN where it is dropped, as in torch's dropout.
        const acc_t factor = words[i] >= threshold ? kept : acc_t(0);
        out[base + i] = static_cast<scalar_t>(static_cast<acc_t>(in[base + i]) * factor);
      }
    }
  });
}

}  // namespace

at::Tensor dropout_cpu(const at::Tensor& input, uint64_t seed, uint64_t offset, uint32_t threshold,
                       double scale) {
  const at::Tensor x = input.contiguous();
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "tpcore_dropout", [&] {
    dropout_chunks(x.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), x.numel(), seed,
                   offset / 4, threshold, scale);
  });
  return out;
}

}  // namespace tpcore
