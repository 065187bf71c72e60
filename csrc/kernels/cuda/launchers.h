// Raw-pointer launchers of tpcore's CUDA kernels. The .cu files that define them include only
// light headers (this one, the CUDA runtime, c10's Half / BFloat16), so nvcc does not parse
// ATen in its host and device passes; the at::Tensor handling, dtype dispatch, device guard
// and current-stream lookup live in the host .cpp files beside them (compiled by the C++
// compiler). Each launcher enqueues its kernel(s) on `stream`; the caller checks the launch.
// Templates are instantiated in the .cu files for float, double, c10::Half and c10::BFloat16,
// with VEC = 1 and VEC = kVec16<T>.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

// Applies M to each element type the launchers are instantiated for (the dtypes the host side
// dispatches on); the .cu files instantiate their templates with it.
#define TPCORE_FOR_EACH_KERNEL_DTYPE(M) M(float) M(double) M(c10::Half) M(c10::BFloat16)

namespace tpcore {

// Elements of T in 16 bytes.
template <typename T>
constexpr int kVec16 = 16 / sizeof(T) > 0 ? 16 / sizeof(T) : 1;

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

namespace cuda_launch {

// Dropout (dropout_kernels.cu): `blocks` blocks of kDropoutThreads threads.
constexpr int kDropoutThreads = 256;
template <typename T>
void dropout(const T* in, T* out, int64_t n, const int64_t* state, uint32_t threshold, double scale,
             int64_t blocks, cudaStream_t stream);

// Cross-entropy (cross_entropy_kernels.cu): one block per row, `blocks` blocks. The
// launchers choose the 16-byte vector width when the rows and pointers allow it.
template <typename T>
void cross_entropy_stats(const T* logits, const int64_t* target, float* stats, int64_t rows,
                         int64_t stride, int64_t vocab_start, int64_t valid, int64_t blocks,
                         cudaStream_t stream);
template <typename T>
void cross_entropy_grad(const T* logits, const int64_t* target, const float* lse,
                        const float* scale, T* out, int64_t rows, int64_t stride,
                        int64_t vocab_start, int64_t valid, float inv_vocab, float smoothing,
                        float z_loss, int64_t blocks, cudaStream_t stream);

// Embedding (embedding_kernels.cu).
constexpr int kEmbeddingThreads = 256;
constexpr int kEmbeddingSumThreads = 128;  // threads per column tile of the backward
template <typename T, int VEC>
void embedding_lookup(const int64_t* ids, const T* weight, T* out, int64_t n, int64_t rows,
                      int64_t dim, int64_t vocab_start, int64_t blocks, cudaStream_t stream);
void embedding_shared_chunks(const int64_t* sk, int32_t* flag, int64_t n, int64_t rows,
                             int64_t blocks, cudaStream_t stream);
template <typename T, int VEC>
void embedding_chunk_sum(const T* grad, const int64_t* sk, const int64_t* order,
                         const int32_t* shared, const int64_t* slot_end, int64_t n, int64_t rows,
                         int64_t dim, float* partial, int64_t* partial_row, T* grad_weight,
                         int64_t blocks, int64_t tiles, cudaStream_t stream);
template <typename T, int VEC>
void embedding_combine(const int64_t* sk, const int32_t* shared, const int64_t* slot_end,
                       const float* partial, const int64_t* partial_row, int64_t n, int64_t slots,
                       int64_t dim, T* grad_weight, int64_t blocks, int64_t tiles,
                       cudaStream_t stream);

}  // namespace cuda_launch
}  // namespace tpcore
