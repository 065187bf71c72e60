// The grid-size cap shared by the CUDA kernels (kept out of the .cu files so that the
// setter exists, and can be bound, in CPU-only builds too).
#include <algorithm>
#include <atomic>
#include <cstdint>

#include "kernels/kernels.h"

namespace tpcore {
namespace {

constexpr int64_t kDefaultMaxGridBlocks = int64_t(1) << 20;
std::atomic<int64_t> max_grid_blocks{kDefaultMaxGridBlocks};

}  // namespace

int64_t grid_blocks(int64_t work) {
  return std::clamp<int64_t>(work, 1, max_grid_blocks.load(std::memory_order_relaxed));
}

void set_max_grid_blocks(int64_t cap) {
  max_grid_blocks.store(cap > 0 ? cap : kDefaultMaxGridBlocks, std::memory_order_relaxed);
}

}  // namespace tpcore
