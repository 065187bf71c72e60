// Vocab-parallel cross-entropy with one collective in the forward and none in the
// backward. Each rank computes per-token (max, sum exp, target logit, sum logits)
// over its shard in one fused pass; the ranks all-gather these small stats and each
// combines them into the global log-sum-exp. Megatron-LM needs three all-reduces.
// The backward recomputes the softmax from the saved logits and log-sum-exp.
#include "tensor_parallel/cross_entropy.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "kernels/cpu/cpu_buffer_pool.h"
#include "kernels/kernels.h"
#include "tensor_parallel/autocast_util.h"
#include "tensor_parallel/autograd_util.h"
#include "tensor_parallel/functions.h"
#include "tensor_parallel/input_checks.h"

namespace tpcore {

VocabShard vocab_shard(const Group& group, int64_t local_vocab, int64_t vocab_size) {
  const int64_t start = group_rank(group) * local_vocab;
  return {start, std::clamp<int64_t>(vocab_size - start, 0, local_vocab)};
}

CrossEntropyOptions make_cross_entropy_options(const char* what, int64_t vocab_size,
                                               int64_t local_vocab, int64_t world,
                                               double label_smoothing, int64_t ignore_index,
                                               int64_t reduction, double z_loss) {
  TORCH_CHECK_VALUE(reduction >= 0 && reduction <= 2, "tpcore: ", what, ": bad reduction code");
  return {vocab_size < 0 ? local_vocab * world : vocab_size, label_smoothing, ignore_index,
          static_cast<Reduction>(reduction), z_loss};
}

void check_loss_dtype(const char* what, const char* name, at::ScalarType dtype) {
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                   "tpcore: ", what, ": ", name, " must be float32, bfloat16 or float16, got ",
                   dtype);
}

void check_cross_entropy_args(const char* what, const at::Tensor& target,
                              c10::SymIntArrayRef expected_shape, const at::Device& device) {
  TORCH_CHECK_TYPE(!at::isFloatingType(target.scalar_type()) && target.scalar_type() != at::kBool,
                   "tpcore: ", what, ": target must be an integer tensor, got ",
                   target.scalar_type());
  TORCH_CHECK_VALUE(same_shape(target.sym_sizes(), expected_shape), "tpcore: ", what,
                    ": target shape ", target.sym_sizes(),
                    " does not match the logits' leading shape ", expected_shape);
  TORCH_CHECK_VALUE(target.device() == device, "tpcore: ", what, ": target is on ", target.device(),
                    " but the logits are on ", device);
}

at::Tensor cross_entropy_stats(const at::Tensor& logits, const at::Tensor& target,
                               const VocabShard& shard) {
#ifdef TPCORE_WITH_CUDA
  if (logits.is_cuda()) return cross_entropy_stats_cuda(logits, target, shard.start, shard.valid);
#endif
  TORCH_CHECK(logits.is_cpu(), "tpcore: cross-entropy: no kernel for device ", logits.device(),
              " in this build");
  return cross_entropy_stats_cpu(logits, target, shard.start, shard.valid);
}

void cross_entropy_grad(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& lse,
                        const at::Tensor& scale, at::Tensor& out, const VocabShard& shard,
                        const CrossEntropyOptions& o) {
#ifdef TPCORE_WITH_CUDA
  if (logits.is_cuda()) {
    return cross_entropy_grad_cuda(logits, target, lse, scale, out, shard.start, shard.valid,
                                   o.vocab_size, o.label_smoothing, o.z_loss);
  }
#endif
  cross_entropy_grad_cpu(logits, target, lse, scale, out, shard.start, shard.valid, o.vocab_size,
                         o.label_smoothing, o.z_loss);
}

TokenLoss combine_cross_entropy_stats(const char* what, const at::Tensor& stats,
                                      const at::Tensor& target, const Group& group,
                                      int64_t local_vocab, const CrossEntropyOptions& o) {
  // Two rows ride along with the stats, whether or not this rank checks, so the all-gather
  // has the same shape on every rank; with checks on they carry what every rank must agree
  // on and whether its input is valid (cross_entropy_checks.cpp).
  const RankCheck check = start_rank_check(what, stats, target, local_vocab, group_size(group), o);
  const int64_t n = stats.size(0);
  at::Tensor all =
      all_gather(at::cat({stats, check.rows}).unsqueeze(0), 0, group);  // [world, N + 2, 4]
  finish_rank_check(what, check, all.narrow(1, n, 2), target, o);
  all = all.narrow(1, 0, n);
  const at::Tensor m = all.select(2, 0), s = all.select(2, 1);
  const at::Tensor max = m.amax(0);
  // Shards with no real column report max = -inf and sum = 0: they add exp(-inf) = 0.
  const at::Tensor lse = max + (s * (m - max).exp()).sum(0).log();
  const at::Tensor target_logit = all.select(2, 2).sum(0);
  const at::Tensor mask = (target != o.ignore_index).to(at::kFloat);
  const double eps = o.label_smoothing;
  // (1 - eps) * NLL + eps * (uniform-target CE over the real vocabulary) + z * lse^2.
  at::Tensor loss = (1.0 - eps) * (lse - target_logit);
  if (eps > 0) loss = loss + eps * (lse - all.select(2, 3).sum(0) / double(o.vocab_size));
  if (o.z_loss > 0) loss = loss + o.z_loss * lse.square();
  return {loss * mask, lse, mask};
}

at::Tensor reduce_loss(const TokenLoss& token, const CrossEntropyOptions& o,
                       const at::Tensor& target_shape_like, at::ScalarType dtype) {
  switch (o.reduction) {
    case Reduction::None:
      return token.loss.view_symint(target_shape_like.sym_sizes()).to(dtype);
    case Reduction::Sum:
      return token.loss.sum().to(dtype);
    case Reduction::Mean:
      break;
  }
  // Like F.cross_entropy: the mean over non-ignored tokens (NaN when all are ignored).
  return (token.loss.sum() / token.mask.sum()).to(dtype);
}

at::Tensor loss_grad_scale(const at::Tensor& grad_loss, const at::Tensor& mask,
                           const CrossEntropyOptions& o) {
  const at::Tensor g = grad_loss.to(at::kFloat);
  switch (o.reduction) {
    case Reduction::None:
      return g.reshape({-1}) * mask;
    case Reduction::Sum:
      return g * mask;
    case Reduction::Mean:
      break;
  }
  // With every target ignored the mean is 0 / 0 = NaN (as in F.cross_entropy), but its
  // gradient is zero there, not 0 * inf.
  return g / mask.sum().clamp_min(1.0) * mask;
}

CrossEntropyOptions load_options(AutogradContext* ctx) {
  auto& d = ctx->saved_data;
  return {d["vocab_size"].toInt(), d["label_smoothing"].toDouble(), d["ignore_index"].toInt(),
          static_cast<Reduction>(d["reduction"].toInt()), d["z_loss"].toDouble()};
}

void save_options(AutogradContext* ctx, const CrossEntropyOptions& o) {
  auto& d = ctx->saved_data;
  d["vocab_size"] = o.vocab_size;
  d["label_smoothing"] = o.label_smoothing;
  d["ignore_index"] = o.ignore_index;
  d["reduction"] = static_cast<int64_t>(o.reduction);
  d["z_loss"] = o.z_loss;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_entropy_forward_kernel(
    const at::Tensor& logits, const at::Tensor& target_, GroupName name, int64_t vocab_size,
    double label_smoothing, int64_t ignore_index, double z_loss) {
  const Group group = group_by_name(name);
  const CrossEntropyOptions options{vocab_size, label_smoothing, ignore_index, Reduction::None,
                                    z_loss};
  const at::Tensor x = logits.contiguous();
  const at::Tensor t = target_.to(at::kLong).contiguous();
  const VocabShard shard = vocab_shard(group, x.size(1), vocab_size);
  TokenLoss token =
      combine_cross_entropy_stats("vocab_parallel_cross_entropy", cross_entropy_stats(x, t, shard),
                                  t, group, x.size(1), options);
  return {token.loss, token.lse, token.mask};
}

at::Tensor cross_entropy_backward_kernel(const at::Tensor& logits, const at::Tensor& target,
                                         const at::Tensor& lse, const at::Tensor& scale,
                                         GroupName name, int64_t vocab_size, double label_smoothing,
                                         double z_loss) {
  const CrossEntropyOptions options{vocab_size, label_smoothing, -100, Reduction::None, z_loss};
  const at::Tensor x = logits.contiguous();
  const VocabShard shard = vocab_shard(group_by_name(name), x.size(1), vocab_size);
  at::Tensor out = x.is_cpu() ? empty_cached_cpu(x.sizes(), x.scalar_type()) : at::empty_like(x);
  cross_entropy_grad(x, target.to(at::kLong).contiguous(), lse, scale, out, shard, options);
  return out;
}

namespace {

struct VocabParallelCrossEntropyFn : public torch::autograd::Function<VocabParallelCrossEntropyFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& target, GroupName group, CrossEntropyOptions options,
                            bool inplace_backward, at::ScalarType loss_dtype) {
    const int64_t local_vocab = concrete(logits.sym_size(-1));
    // The logits themselves are saved (not a view made here), so autograd's version check
    // guards them; a non-contiguous input is saved as its contiguous copy.
    const at::Tensor saved_logits = logits.contiguous();
    const at::Tensor x = saved_logits.view({-1, local_vocab});
    const at::Tensor t = target.reshape({-1}).to(at::kLong).contiguous();
    auto [loss, lse, mask] =
        op::cross_entropy_forward(x, t, group, options.vocab_size, options.label_smoothing,
                                  options.ignore_index, options.z_loss);
    save_group(ctx, group);
    save_options(ctx, options);
    ctx->saved_data["inplace_backward"] = inplace_backward;
    ctx->saved_data["logits_shape"] = c10::IValue(logits.sym_sizes());
    // Nothing [tokens, vocab]-sized is saved beyond the logits themselves.
    ctx->save_for_backward({saved_logits, t, lse, mask});
    return reduce_loss({loss, lse, mask}, options, target, loss_dtype);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const CrossEntropyOptions options = load_options(ctx);
    const std::string group = load_group(ctx);
    auto saved = ctx->get_saved_variables();
    const at::Tensor x = as_2d(saved[0]);
    const at::Tensor &t = saved[1], &lse = saved[2], &mask = saved[3];
    const at::Tensor scale = loss_grad_scale(grads[0], mask, options);
    at::Tensor out;
    if (ctx->saved_data["inplace_backward"].toBool()) {
      // Eager only (vocab_parallel_cross_entropy turns it off when traced): the kernel
      // itself, writing into the logits.
      out = x;
      const VocabShard shard = vocab_shard(group_by_name(group), x.size(1), options.vocab_size);
      cross_entropy_grad(x, t, lse, scale, out, shard, options);
      // The logits now hold their gradient: whoever saved them (another node, or this one
      // under retain_graph=True) must get autograd's "modified by an inplace operation"
      // error instead of a silently wrong gradient.
      torch::autograd::impl::bump_version(x);
    } else {
      out = op::cross_entropy_backward(x, t, lse, scale, group, options.vocab_size,
                                       options.label_smoothing, options.z_loss);
    }
    const auto shape = ctx->saved_data["logits_shape"].toSymIntVector();
    // Not a view (a view would stop autograd from stealing the buffer into .grad: a copy).
    return {at::_unsafe_view_symint(out, shape),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                        GroupName group, int64_t vocab_size, double label_smoothing,
                                        int64_t ignore_index, int64_t reduction, double z_loss,
                                        bool inplace_backward) {
  const char* what = "vocab_parallel_cross_entropy";
  const int world = group_size(group_by_name(group));
  check_loss_dtype(what, "logits", logits.scalar_type());
  TORCH_CHECK_VALUE(logits.dim() >= 1, "tpcore: ", what, ": logits must have a vocab dim");
  const int64_t local_vocab = concrete(logits.sym_size(-1));
  const CrossEntropyOptions options = make_cross_entropy_options(
      what, vocab_size, local_vocab, world, label_smoothing, ignore_index, reduction, z_loss);
  check_cross_entropy_args(what, target, logits.sym_sizes().slice(0, logits.dim() - 1),
                           logits.device());
  // Writing the gradient into a leaf (or into a view of one) would overwrite a parameter
  // or an input the caller still owns.
  const at::TensorBase& owner =
      logits.is_view() ? logits._base() : static_cast<const at::TensorBase&>(logits);
  TORCH_CHECK_VALUE(!(inplace_backward && owner.is_leaf() && owner.requires_grad()),
                    "tpcore: ", what,
                    ": inplace_backward=True would overwrite a leaf tensor's data with its ",
                    "gradient; pass logits computed by an operation (e.g. the LM head's output)");
  // Traced (torch.compile, export): the out-of-place backward, the same numbers; a graph
  // cannot overwrite a tensor it saved.
  if (is_traced(logits)) inplace_backward = false;
  // The math is fp32 whatever the logits; the loss comes back in the logits' dtype, or in
  // fp32 under autocast, as F.cross_entropy's would.
  const at::ScalarType loss_dtype = autocast_dtype(logits) ? at::kFloat : logits.scalar_type();
  const NoAutocast no_autocast;
  return VocabParallelCrossEntropyFn::apply(logits, target, group, options, inplace_backward,
                                            loss_dtype);
}

}  // namespace tpcore
