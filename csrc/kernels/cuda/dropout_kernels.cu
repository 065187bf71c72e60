// CUDA kernel of the counter-based dropout (kernels/philox.h). The (seed, offset) pair is read
// from device memory inside the kernel, so a CUDA graph replays it with the values of each
// replay, and no host copy is needed. Light headers only: the host side is dropout_cuda.cpp.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "kernels/cuda/launchers.h"
#include "kernels/philox.h"

namespace tpcore {
namespace {

// at::opmath_type for the dtypes dropout is built for (ATen/OpMathType.h, without ATen).
template <typename T>
struct OpMath {
  using type = T;
};
template <>
struct OpMath<c10::Half> {
  using type = float;
};
template <>
struct OpMath<c10::BFloat16> {
  using type = float;
};
template <typename T>
using opmath_t = typename OpMath<T>::type;

template <typename scalar_t>
__global__ void dropout_kernel(const scalar_t* __restrict__ in, scalar_t* __restrict__ out,
                               int64_t n, const int64_t* __restrict__ state, uint32_t threshold,
                               opmath_t<scalar_t> scale) {
  using acc_t = opmath_t<scalar_t>;
  const uint64_t seed = static_cast<uint64_t>(state[0]);
  const uint64_t first = static_cast<uint64_t>(state[1]) / 4;
  const int64_t blocks = (n + 3) / 4;
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < blocks;
       b += int64_t(gridDim.x) * blockDim.x) {
    const Philox4 r = dropout_block(seed, first + static_cast<uint64_t>(b));
    const int64_t base = b * 4;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      if (base + l < n) {
        const acc_t factor = r.v[l] >= threshold ? scale : acc_t(0);
        out[base + l] = static_cast<scalar_t>(static_cast<acc_t>(in[base + l]) * factor);
      }
    }
  }
}

}  // namespace

namespace cuda_launch {

template <typename T>
void dropout(const T* in, T* out, int64_t n, const int64_t* state, uint32_t threshold, double scale,
             int64_t blocks, cudaStream_t stream) {
  dropout_kernel<T><<<blocks, kDropoutThreads, 0, stream>>>(in, out, n, state, threshold,
                                                            static_cast<opmath_t<T>>(scale));
}

#define TPCORE_INSTANTIATE(T)                                                                \
  template void dropout<T>(const T*, T*, int64_t, const int64_t*, uint32_t, double, int64_t, \
                           cudaStream_t);
TPCORE_FOR_EACH_KERNEL_DTYPE(TPCORE_INSTANTIATE)
#undef TPCORE_INSTANTIATE

}  // namespace cuda_launch
}  // namespace tpcore
