// Whether the current stream of a CUDA device is capturing a graph (no sync, no launch).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "kernels/kernels.h"

namespace tpcore {

bool cuda_stream_capturing(const at::Device& device) {
  const c10::cuda::CUDAGuard guard(device);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(at::cuda::getCurrentCUDAStream(), &status));
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace tpcore
