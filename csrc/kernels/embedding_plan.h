// How the deterministic embedding backward splits its work, shared by the CUDA kernels
// and their CPU reference (so a CPU test checks the same plan the GPU runs).
//
// The token ids are turned into keys (the local row, or `rows` for tokens of other ranks and
// padding_idx) and sorted stably: `sk` [n] holds the sorted keys and a token's gradient row
// is summed in token order. A segment is a run of equal keys. A chunk starts at a segment's
// start and at every multiple of kChunk inside a segment, so a chunk is at most kChunk
// tokens of one row. A row with one chunk (at most kChunk tokens, not crossing a multiple of
// kChunk) writes its sum straight to grad_weight; the chunks of a row with several are
// summed in parallel into fp32 partial slots (their order is their position in `sk`) and
// combined in that order. Every sum runs in a fixed order: the result is deterministic.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define TPCORE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TPCORE_HOST_DEVICE inline
#endif

namespace tpcore::embedding_plan {

constexpr int64_t kChunk = 32;

TPCORE_HOST_DEVICE bool segment_start(const int64_t* sk, int64_t i) {
  return i == 0 || sk[i - 1] != sk[i];
}

// Whether a chunk of a row of this shard starts at position i.
TPCORE_HOST_DEVICE bool chunk_start(const int64_t* sk, int64_t i, int64_t rows) {
  return sk[i] < rows && (i % kChunk == 0 || segment_start(sk, i));
}

// One past the last position of the chunk starting at i.
TPCORE_HOST_DEVICE int64_t chunk_end(const int64_t* sk, int64_t i, int64_t n) {
  const int64_t limit = (i / kChunk + 1) * kChunk < n ? (i / kChunk + 1) * kChunk : n;
  int64_t j = i + 1;
  while (j < limit && sk[j] == sk[i]) ++j;
  return j;
}

// Whether the chunk starting at i shares its row with another chunk (it goes to a partial
// slot): it does not start its segment, or its segment goes on past the next multiple of
// kChunk.
TPCORE_HOST_DEVICE bool shared_chunk(const int64_t* sk, int64_t i, int64_t n, int64_t rows) {
  if (!chunk_start(sk, i, rows)) return false;
  if (!segment_start(sk, i)) return true;
  const int64_t next = (i / kChunk + 1) * kChunk;
  return next < n && sk[next] == sk[i];
}

// At most this many shared chunks among n tokens: those that do not start their segment sit
// on distinct multiples of kChunk, and each segment with several chunks contains a distinct
// multiple of kChunk after its start.
TPCORE_HOST_DEVICE int64_t max_shared_chunks(int64_t n) { return 2 * ((n + kChunk - 1) / kChunk); }

}  // namespace tpcore::embedding_plan
