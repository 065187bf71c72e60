// Per-device kernels behind tpcore's vocab-parallel embedding and cross-entropy.
// The dispatching code (embedding.cpp, cross_entropy.cpp) validates arguments;
// kernels assume contiguous inputs of the documented shapes.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace tpcore {

// Blocks to launch for `work` independent units (rows, tokens, segments). Kernels stride
// over the grid, so any count is covered while the grid stays under CUDA's limits (its x
// dimension stops at 2^31 - 1). Tests lower the cap with set_max_grid_blocks to exercise
// the striding on small inputs; a cap <= 0 restores the default.
int64_t grid_blocks(int64_t work);
void set_max_grid_blocks(int64_t cap);

// out[t] = weight[ids[t] - vocab_start] when vocab_start <= ids[t] < vocab_start + rows,
// else zeros. ids [N] int64, weight [rows, D] contiguous, out [N, D] contiguous (written).
void embedding_lookup_cpu(const at::Tensor& ids, const at::Tensor& weight, int64_t vocab_start,
                          const at::Tensor& out);
// grad_weight[ids[t] - vocab_start] += grad_out[t] for ids in this shard, except padding_idx
// (-1 for none); summed in token order, so the result is deterministic. Returns
// grad_weight [rows, D] in grad_out's dtype.
at::Tensor embedding_backward_cpu(const at::Tensor& ids, const at::Tensor& grad_out, int64_t rows,
                                  int64_t vocab_start, int64_t padding_idx);

// The CUDA backward's algorithm run on the CPU (kernels/embedding_plan.h), for tests:
// (grad_weight, shared chunks used, their bound). Any device's tensors; computes on the CPU.
std::tuple<at::Tensor, int64_t, int64_t> embedding_backward_chunked_reference(
    const at::Tensor& ids, const at::Tensor& grad_out, int64_t rows, int64_t vocab_start,
    int64_t padding_idx);

// Per-token statistics of logits [N, V_local] over its first `valid` columns (the rest
// is vocabulary padding): stats [N, 4] float32 = (max, sum exp(x - max), x[target]
// if the target falls in this shard else 0, sum x).
at::Tensor cross_entropy_stats_cpu(const at::Tensor& logits, const at::Tensor& target,
                                   int64_t vocab_start, int64_t valid);
// grad [N, V_local] (into `out`, which may alias logits) for j < valid:
//   scale[t] * (exp(x - lse[t]) * (1 + 2 z lse[t]) - smoothing / vocab - (1 - smoothing) [j ==
//   target])
// and 0 for padding columns.
void cross_entropy_grad_cpu(const at::Tensor& logits, const at::Tensor& target,
                            const at::Tensor& lse, const at::Tensor& scale, at::Tensor& out,
                            int64_t vocab_start, int64_t valid, int64_t vocab, double smoothing,
                            double z_loss);

// Counter-based dropout (kernels/philox.h): out = input * (keep ? scale : 0), element i kept
// when word i % 4 of the Philox block offset / 4 + i / 4 under key `seed` is >= threshold.
// Returns a contiguous tensor of input's shape. The CUDA kernel reads (seed, offset) from
// `state`, an int64 [2] tensor on the input's device.
at::Tensor dropout_cpu(const at::Tensor& input, uint64_t seed, uint64_t offset, uint32_t threshold,
                       double scale);

#ifdef TPCORE_WITH_CUDA
at::Tensor dropout_cuda(const at::Tensor& input, const at::Tensor& state, uint32_t threshold,
                        double scale);
// Whether `device`'s current stream is capturing a CUDA graph.
bool cuda_stream_capturing(const at::Device& device);
void embedding_lookup_cuda(const at::Tensor& ids, const at::Tensor& weight, int64_t vocab_start,
                           const at::Tensor& out);
at::Tensor embedding_backward_cuda(const at::Tensor& ids, const at::Tensor& grad_out, int64_t rows,
                                   int64_t vocab_start, int64_t padding_idx);
at::Tensor cross_entropy_stats_cuda(const at::Tensor& logits, const at::Tensor& target,
                                    int64_t vocab_start, int64_t valid);
void cross_entropy_grad_cuda(const at::Tensor& logits, const at::Tensor& target,
                             const at::Tensor& lse, const at::Tensor& scale, at::Tensor& out,
                             int64_t vocab_start, int64_t valid, int64_t vocab, double smoothing,
                             double z_loss);
#endif

}  // namespace tpcore
