// Streaming (non-temporal) stores for collective outputs that cannot stay in cache: they
// write around the caches, which saves the read-for-ownership of every output line. See
// Config::stream_bytes.
#pragma once

#include <cstddef>

namespace tpcore::shm {

// memcpy with streaming stores for the 16-byte-aligned middle (plain stores elsewhere, and
// everywhere on CPUs without SSE2). Call store_fence() before other threads or processes
// may read what it wrote.
void stream_copy(void* dst, const void* src, size_t bytes);
// Orders earlier streaming stores before later stores (sfence): before a collective
// returns.
void store_fence();
// The last-level cache's size in bytes (sysfs, else sysconf, else 32 MiB).
size_t last_level_cache_bytes();

}  // namespace tpcore::shm
