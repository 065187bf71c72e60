#include "comm/shm/stream_store.h"

#include <unistd.h>

#include <cstdint>
#include <cstdio>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace tpcore::shm {

void store_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

size_t last_level_cache_bytes() {
  // sysfs first: it gives the cache a core shares (32 MiB on the 2-core EPYC VM), where
  // sysconf can report the whole package's (384 MiB there).
  for (int index = 4; index >= 0; --index) {
    char path[96];
    std::snprintf(path, sizeof(path), "/sys/devices/system/cpu/cpu0/cache/index%d/size", index);
    FILE* f = std::fopen(path, "r");
    if (!f) continue;
    unsigned long value = 0;
    char unit = 0;
    const int got = std::fscanf(f, "%lu%c", &value, &unit);
    std::fclose(f);
    if (got >= 1 && value > 0)
      return static_cast<size_t>(value) * (unit == 'K' ? 1024 : unit == 'M' ? (1 << 20) : 1);
  }
#ifdef _SC_LEVEL3_CACHE_SIZE
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (l3 > 0) return static_cast<size_t>(l3);
#endif
  return 32 << 20;
}

}  // namespace tpcore::shm
