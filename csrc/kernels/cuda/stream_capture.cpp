// Whether the current stream of a CUDA device is capturing a graph (no sync, no launch).
// Host code only, so it is compiled by the C++ compiler rather than nvcc.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "kernels/kernels.h"

namespace tpcore {

bool cuda_stream_capturing(const at::Device& device) {
  const c10::cuda::CUDAGuard guard(device);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(), &status));
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace tpcore
