// Pieces shared by the vocab-parallel cross-entropy and its fused linear variant.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "comm/comm.h"

namespace torch::autograd {
struct AutogradContext;
}

namespace tpcore {

enum class Reduction : int64_t { None = 0, Mean = 1, Sum = 2 };

struct CrossEntropyOptions {
  int64_t vocab_size;  // the real global vocabulary; columns beyond it are padding
  double label_smoothing;
  int64_t ignore_index;
  Reduction reduction;
  double z_loss;
};

// Keep the options in an autograd context for backward, and read them back.
void save_options(torch::autograd::AutogradContext* ctx, const CrossEntropyOptions& options);
CrossEntropyOptions load_options(torch::autograd::AutogradContext* ctx);

// Where this rank's shard of V_local columns starts, and how many of them are real.
struct VocabShard {
  int64_t start;
  int64_t valid;
};
VocabShard vocab_shard(const Group& group, int64_t local_vocab, int64_t vocab_size);

// The options of a call from its arguments: checks the reduction code and fills the
// default vocab_size (< 0: every column of the shards, local_vocab x world).
CrossEntropyOptions make_cross_entropy_options(const char* what, int64_t vocab_size,
                                               int64_t local_vocab, int64_t world,
                                               double label_smoothing, int64_t ignore_index,
                                               int64_t reduction, double z_loss);
// Raises a TypeError unless `dtype` is float32, bfloat16 or float16 (`name` says of what).
void check_loss_dtype(const char* what, const char* name, at::ScalarType dtype);

// Validates the target (shape `expected_shape`, integer) and its device; raises before any
// collective. Reads no values: fake (traced) tensors pass through. The options' values are
// checked by the forward, on every rank alike (start_rank_check).
void check_cross_entropy_args(const char* what, const at::Tensor& target,
                              c10::SymIntArrayRef expected_shape, const at::Device& device);

// What the TP ranks check together, through the forward's one all-gather: that they agree
// on the local vocabulary and the options, and that none has invalid options or a target
// neither in range nor ignored. Every rank then raises alike, naming the rank at fault.
// `rows` [2, 4] go with the stats; with checks off (tpcore.set_input_checks(False), CUDA
// graph capture) they are zeros, an invalid option raises on this rank at once (as the
// ranks are assumed to agree), and nothing is read back.
struct RankCheck {
  bool on = false;
  std::string problem;  // this rank's invalid option, or ""
  at::Tensor bad;       // [N] bool: targets neither in range nor ignored (checks on)
  at::Tensor rows;      // [2, 4] in the stats' dtype and device
};
RankCheck start_rank_check(const char* what, const at::Tensor& stats, const at::Tensor& target,
                           int64_t local_vocab, int64_t world, const CrossEntropyOptions& options);
// `gathered` [world, 2, 4]: every rank's rows. One host read (the only one of the forward).
void finish_rank_check(const char* what, const RankCheck& check, const at::Tensor& gathered,
                       const at::Tensor& target, const CrossEntropyOptions& options);

// Per-token (max, sum exp, target logit, sum logits) of this rank's shard [N, V_local].
at::Tensor cross_entropy_stats(const at::Tensor& logits, const at::Tensor& target,
                               const VocabShard& shard);
// Gradient of the loss wrt logits [N, V_local], written into `out` (may alias logits).
void cross_entropy_grad(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& lse,
                        const at::Tensor& scale, at::Tensor& out, const VocabShard& shard,
                        const CrossEntropyOptions& options);

struct TokenLoss {
  at::Tensor loss;  // [N] float32, zero where ignored
  at::Tensor lse;   // [N] float32, log-sum-exp over the whole vocabulary
  at::Tensor mask;  // [N] float32, 1 where the target is not ignored
};
// Exchanges the per-token stats [N, 4] of every rank (one all-gather) and combines them.
// With input checks on, the all-gather also carries `local_vocab` and the options, and every
// rank raises alike when the ranks disagree on them.
TokenLoss combine_cross_entropy_stats(const char* what, const at::Tensor& stats,
                                      const at::Tensor& target, const Group& group,
                                      int64_t local_vocab, const CrossEntropyOptions& options);
// Applies the reduction; `like` gives the output dtype and, for None, the shape.
at::Tensor reduce_loss(const TokenLoss& token, const CrossEntropyOptions& options,
                       const at::Tensor& target_shape_like, at::ScalarType dtype);
// d(reduced loss)/d(per-token loss) times the incoming gradient: [N] float32.
at::Tensor loss_grad_scale(const at::Tensor& grad_loss, const at::Tensor& mask,
                           const CrossEntropyOptions& options);

}  // namespace tpcore
