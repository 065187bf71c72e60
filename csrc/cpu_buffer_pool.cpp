#include "cpu_buffer_pool.h"

#include <ATen/ATen.h>

#include <cstdlib>
#include <mutex>
#include <vector>

namespace tpcore {
namespace {

// Small buffers are cheap to allocate; only large ones are worth keeping.
constexpr size_t kMinCachedBytes = size_t(1) << 20;
constexpr size_t kAlignment = 64;

size_t limit_from_env() {
  const char* mb = std::getenv("TPCORE_CPU_CACHE_MB");
  return (mb ? std::strtoull(mb, nullptr, 10) : 4096) << 20;
}

class BufferPool {
 public:
  void* take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 0; i < free_.size(); ++i) {
        if (free_[i].bytes == bytes) {
          void* ptr = free_[i].ptr;
          cached_ -= bytes;
          free_.erase(free_.begin() + i);
          return ptr;
        }
      }
    }
    void* ptr = nullptr;
    TORCH_CHECK(posix_memalign(&ptr, kAlignment, bytes) == 0, "tpcore: out of memory allocating ",
                bytes, " bytes");
    return ptr;
  }

  void give_back(void* ptr, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    // Keep the newest buffers: evict the oldest until this one fits.
    while (!free_.empty() && cached_ + bytes > limit_) {
      std::free(free_.front().ptr);
      cached_ -= free_.front().bytes;
      free_.erase(free_.begin());
    }
    if (bytes >= kMinCachedBytes && bytes <= limit_) {
      free_.push_back({ptr, bytes});
      cached_ += bytes;
    } else {
      std::free(ptr);
    }
  }

  int64_t clear() {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t released = static_cast<int64_t>(cached_);
    for (auto& block : free_) std::free(block.ptr);
    free_.clear();
    cached_ = 0;
    return released;
  }

 private:
  struct Block {
    void* ptr;
    size_t bytes;
  };
  std::mutex mu_;
  std::vector<Block> free_;
  size_t cached_ = 0;
  const size_t limit_ = limit_from_env();
};

// Never destroyed: tensors may be freed during interpreter shutdown, after statics.
BufferPool& pool() {
  static BufferPool* p = new BufferPool();
  return *p;
}

}  // namespace

at::Tensor empty_cached_cpu(at::IntArrayRef shape, at::ScalarType dtype) {
  const size_t bytes = static_cast<size_t>(c10::multiply_integers(shape)) * c10::elementSize(dtype);
  if (bytes < kMinCachedBytes) return at::empty(shape, at::TensorOptions().dtype(dtype));
  void* ptr = pool().take(bytes);
  return at::from_blob(
      ptr, shape, [bytes](void* p) { pool().give_back(p, bytes); },
      at::TensorOptions().dtype(dtype).device(at::kCPU));
}

int64_t empty_cpu_cache() { return pool().clear(); }

}  // namespace tpcore
