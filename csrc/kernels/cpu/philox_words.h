// Philox4x32-10 words for a run of blocks on the CPU (kernels/philox.h), built twice: for the
// baseline target and with AVX2 (eight blocks per vector, four vectors in flight), picked
// once at run time. No ATen headers here, as in softmax_loops.h.
#pragma once

#include <cstdint>

namespace tpcore {

// out[4 b + l] = word l of block (first + b), for b in [0, blocks).
using PhiloxWordsFn = void (*)(uint64_t key, uint64_t first, int64_t blocks, uint32_t* out);

// The fastest variant this CPU supports.
PhiloxWordsFn philox_words();

}  // namespace tpcore
