// 16-byte vector access for the CUDA kernels: VEC elements of T in one load or store.
#pragma once

#include <cstdint>

#include "kernels/cuda/launchers.h"  // kVec16, aligned16

namespace tpcore {

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <int VEC, typename T>
__device__ __forceinline__ Pack<T, VEC> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, VEC>*>(p);
}

template <int VEC, typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, VEC>& x) {
  *reinterpret_cast<Pack<T, VEC>*>(p) = x;
}

}  // namespace tpcore
