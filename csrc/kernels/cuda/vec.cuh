// 16-byte vector access for the CUDA kernels: VEC elements of T in one load or store.
#pragma once

#include <cstdint>

namespace tpcore {

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// Elements of T in 16 bytes.
template <typename T>
constexpr int kVec16 = 16 / sizeof(T) > 0 ? 16 / sizeof(T) : 1;

template <int VEC, typename T>
__device__ __forceinline__ Pack<T, VEC> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, VEC>*>(p);
}

template <int VEC, typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, VEC>& x) {
  *reinterpret_cast<Pack<T, VEC>*>(p) = x;
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace tpcore
