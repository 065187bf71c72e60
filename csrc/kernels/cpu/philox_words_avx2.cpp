// Philox4x32-10 words with AVX2 (CMake sets -mavx2 for this file only): the lanes of a vector
// hold eight blocks' counter words, and four such vectors go through the rounds together so
// the multiplies' latency overlaps. Same words as kernels/philox.h, in the same order.
#include <immintrin.h>

#include "kernels/cpu/philox_words.h"
#include "kernels/philox.h"

namespace tpcore {
namespace {

constexpr int kVectors = 4;                    // in flight together
constexpr int kBlocksPerGroup = 8 * kVectors;  // 32 blocks, 128 words

// The high and low 32 bits of the eight products c * m.
inline void mulhilo(__m256i c, __m256i m, __m256i& hi, __m256i& lo) {
  const __m256i even = _mm256_mul_epu32(c, m);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(c, 32), m);
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

void group(uint64_t key, uint64_t first, uint32_t* out) {
  __m256i c0[kVectors], c1[kVectors], c2[kVectors], c3[kVectors];
  const __m256i lane = _mm256_setr_epi64x(0, 1, 2, 3);
  const __m256i evens_then_odds = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  for (int g = 0; g < kVectors; ++g) {
    // Eight 64-bit block numbers split into their low (c0) and high (c1) words.
    const uint64_t base = first + 8 * g;
    const __m256i a = _mm256_permutevar8x32_epi32(
        _mm256_add_epi64(_mm256_set1_epi64x(static_cast<int64_t>(base)), lane), evens_then_odds);
    const __m256i b = _mm256_permutevar8x32_epi32(
        _mm256_add_epi64(_mm256_set1_epi64x(static_cast<int64_t>(base + 4)), lane),
        evens_then_odds);
    c0[g] = _mm256_permute2x128_si256(a, b, 0x20);
    c1[g] = _mm256_permute2x128_si256(a, b, 0x31);
    c2[g] = c3[g] = _mm256_setzero_si256();
  }
  __m256i k0 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(key)));
  __m256i k1 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(key >> 32)));
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(0xCD9E8D57u));
  const __m256i w0 = _mm256_set1_epi32(static_cast<int>(0x9E3779B9u));
  const __m256i w1 = _mm256_set1_epi32(static_cast<int>(0xBB67AE85u));
  for (int round = 0; round < 10; ++round) {
    for (int g = 0; g < kVectors; ++g) {
      __m256i hi0, lo0, hi1, lo1;
      mulhilo(c0[g], m0, hi0, lo0);
      mulhilo(c2[g], m1, hi1, lo1);
      c0[g] = _mm256_xor_si256(_mm256_xor_si256(hi1, c1[g]), k0);
      c1[g] = lo1;
      c2[g] = _mm256_xor_si256(_mm256_xor_si256(hi0, c3[g]), k1);
      c3[g] = lo0;
    }
    k0 = _mm256_add_epi32(k0, w0);
    k1 = _mm256_add_epi32(k1, w1);
  }
  for (int g = 0; g < kVectors; ++g) {
    // Transpose (word, block) to block-major: four words per block, blocks in order.
    const __m256i t0 = _mm256_unpacklo_epi32(c0[g], c1[g]),
                  t1 = _mm256_unpackhi_epi32(c0[g], c1[g]);
    const __m256i t2 = _mm256_unpacklo_epi32(c2[g], c3[g]),
                  t3 = _mm256_unpackhi_epi32(c2[g], c3[g]);
    const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    auto* o = reinterpret_cast<__m256i*>(out + 32 * g);
    _mm256_storeu_si256(o + 0, _mm256_permute2x128_si256(u0, u1, 0x20));
    _mm256_storeu_si256(o + 1, _mm256_permute2x128_si256(u2, u3, 0x20));
    _mm256_storeu_si256(o + 2, _mm256_permute2x128_si256(u0, u1, 0x31));
    _mm256_storeu_si256(o + 3, _mm256_permute2x128_si256(u2, u3, 0x31));
  }
}

}  // namespace

void philox_words_avx2(uint64_t key, uint64_t first, int64_t blocks, uint32_t* out) {
  int64_t b = 0;
  for (; b + kBlocksPerGroup <= blocks; b += kBlocksPerGroup) {
    group(key, first + static_cast<uint64_t>(b), out + 4 * b);
  }
  dropout_words(key, first + static_cast<uint64_t>(b), blocks - b, out + 4 * b);
}

}  // namespace tpcore
