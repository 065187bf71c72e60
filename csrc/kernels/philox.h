// Philox4x32-10, the counter-based generator of Salmon et al., "Parallel random numbers: as
// easy as 1, 2, 3" (SC 2011): four 32-bit words that depend only on (key, counter), so any
// element's random number is computed where it is needed, in any order, on any device, and a
// CPU and a GPU given the same (seed, offset) draw the same bits. Host and device code.
#pragma once

#include <cstdint>

// Internal linkage: the AVX2 translation unit includes this too, and an inline function
// with one shared definition could reach the baseline build compiled for AVX2.
#if defined(__CUDACC__)
#define TPCORE_HOST_DEVICE static __host__ __device__ __forceinline__
#else
#define TPCORE_HOST_DEVICE static inline
#endif

namespace tpcore {

struct Philox4 {
  uint32_t v[4];
};

// One Philox4x32-10 block: 10 rounds of two 32x32 -> 64-bit multiplies, the key bumped by the
// Weyl constants between rounds (the paper's section 4.2 constants).
TPCORE_HOST_DEVICE Philox4 philox4x32_10(uint64_t key, uint32_t c0, uint32_t c1, uint32_t c2,
                                         uint32_t c3) {
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(0xD2511F53u) * c0;
    const uint64_t p1 = uint64_t(0xCD9E8D57u) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return {{c0, c1, c2, c3}};
}

// Dropout's stream: element i of a draw at `offset` (a multiple of 4) takes word i % 4 of the
// block whose 64-bit counter is offset / 4 + i / 4; the element is kept when that word is at
// least `threshold` (= p * 2^32), so it is dropped with probability p.
TPCORE_HOST_DEVICE Philox4 dropout_block(uint64_t seed, uint64_t block) {
  return philox4x32_10(seed, static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), 0u,
                       0u);
}

// words[4 b + l] = word l of dropout block (first + b), for b in [0, blocks).
TPCORE_HOST_DEVICE void dropout_words(uint64_t seed, uint64_t first, int64_t blocks,
                                      uint32_t* words) {
  for (int64_t b = 0; b < blocks; ++b) {
    const Philox4 r = dropout_block(seed, first + static_cast<uint64_t>(b));
    for (int l = 0; l < 4; ++l) words[4 * b + l] = r.v[l];
  }
}

}  // namespace tpcore
