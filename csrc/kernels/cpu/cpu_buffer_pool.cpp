#include "kernels/cpu/cpu_buffer_pool.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/CPUAllocator.h>

#include <cstdlib>
#include <deque>
#include <mutex>
#include <unordered_map>

namespace tpcore {
namespace {

// Small buffers are cheap to allocate; only large ones are worth keeping.
constexpr size_t kMinCachedBytes = size_t(1) << 20;
constexpr size_t kDefaultLimitMB = 256;

size_t limit_from_env() {
  const char* mb = std::getenv("TPCORE_CPU_CACHE_MB");
  return static_cast<size_t>(mb ? std::strtoull(mb, nullptr, 10) : kDefaultLimitMB) << 20;
}

class BufferPool {
 public:
  // A buffer of exactly `bytes`, cached or new; owned by the pool until give_back.
  void* take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->bytes == bytes) {
          void* ptr = it->data.get();
          cached_ -= bytes;
          in_use_.emplace(ptr, std::move(*it));
          free_.erase(it);
          return ptr;
        }
      }
    }
    c10::DataPtr data = c10::GetCPUAllocator()->allocate(bytes);
    void* ptr = data.get();
    std::lock_guard<std::mutex> lock(mu_);
    in_use_.emplace(ptr, Block{std::move(data), bytes});
    return ptr;
  }

  // Called when the tensor holding `ptr` is freed: keep it if it fits under the limit,
  // evicting the oldest cached buffers first; otherwise release it.
  void give_back(void* ptr) {
    Block dropped;  // released after the lock, like the evicted ones
    std::deque<Block> evicted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = in_use_.find(ptr);
      Block block = std::move(it->second);
      in_use_.erase(it);
      if (block.bytes > limit_) {
        dropped = std::move(block);
      } else {
        while (cached_ + block.bytes > limit_) {
          cached_ -= free_.front().bytes;
          evicted.push_back(std::move(free_.front()));
          free_.pop_front();
        }
        cached_ += block.bytes;
        free_.push_back(std::move(block));
      }
    }
  }

  int64_t clear() {
    std::deque<Block> released;
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t bytes = static_cast<int64_t>(cached_);
    released.swap(free_);
    cached_ = 0;
    return bytes;
  }

 private:
  struct Block {
    c10::DataPtr data;
    size_t bytes = 0;
  };
  std::mutex mu_;
  std::deque<Block> free_;  // oldest first
  std::unordered_map<void*, Block> in_use_;
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
      ptr, shape, [](void* p) { pool().give_back(p); },
      at::TensorOptions().dtype(dtype).device(at::kCPU));
}

int64_t empty_cpu_cache() { return pool().clear(); }

}  // namespace tpcore
