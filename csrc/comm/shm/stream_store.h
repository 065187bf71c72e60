// Streaming (non-temporal) stores for collective outputs that cannot stay in cache: they
// write around the caches, which saves the read-for-ownership of every output line (see
// Config::stream_bytes; the store loop itself is in reduce_loops_impl.h).
#pragma once

#include <cstddef>

namespace tpcore::shm {

// Orders earlier streaming stores before later stores (sfence): before a collective
// returns, so whoever reads its output next sees every line.
void store_fence();
// The last-level cache's size in bytes (sysfs, else sysconf, else 32 MiB).
size_t last_level_cache_bytes();

}  // namespace tpcore::shm
