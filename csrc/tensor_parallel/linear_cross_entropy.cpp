// Fused LM head + vocab-parallel cross-entropy: logits = hidden @ weight_shard^T are
// computed chunk by chunk of tokens and reduced to per-token stats at once, so the
// [tokens, vocab/tp] logits never exist. The backward recomputes each chunk's logits,
// turns them into their gradient in place, and feeds both GEMMs from that buffer.
#include <ATen/ATen.h>
#include <torch/version.h>

#include <algorithm>
#include <vector>

#include "kernels/cpu/cpu_buffer_pool.h"
#include "tensor_parallel/autocast_util.h"
#include "tensor_parallel/autograd_util.h"
#include "tensor_parallel/cross_entropy.h"
#include "tensor_parallel/functions.h"

namespace tpcore {
namespace {

// h_c @ weight^T; on CPU into a cached buffer, as every chunk needs one of the same size.
at::Tensor chunk_logits(const at::Tensor& h_c, const at::Tensor& weight) {
  if (!h_c.is_cpu()) return at::mm(h_c, weight.t());
  at::Tensor out = empty_cached_cpu({h_c.size(0), weight.size(0)}, h_c.scalar_type());
  return at::mm_out(out, h_c, weight.t());
}

// grad_weight (fp32) += g^T h for one chunk of low-precision g [n, V_local] and h [n, H],
// accumulated in fp32 without a [V_local, H] temporary rounded to g's dtype.
void accumulate_weight_grad(at::Tensor& grad_weight, const at::Tensor& g, const at::Tensor& h) {
  if (g.scalar_type() == at::kFloat) {
    grad_weight.addmm_(g.t(), h);
    return;
  }
  // addmm_out's out_dtype overload exists from torch 2.8, but CUDA addmm accepts an fp32
  // `self` beside bf16 / fp16 matrices only from 2.10 (pytorch PR #167931); 2.8 and 2.9
  // raise "self and mat2 must have the same dtype".
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 10)
  if (g.is_cuda()) {  // cuBLAS: bf16 / fp16 inputs, fp32 accumulator and output
    at::addmm_out(grad_weight, grad_weight, g.t(), h, at::kFloat);
    return;
  }
#endif
  // Elsewhere the chunk is widened to fp32 (temporaries the size of the chunk, not of W).
  grad_weight.addmm_(g.t().to(at::kFloat), h.to(at::kFloat));
}

struct LinearCrossEntropyFn : public torch::autograd::Function<LinearCrossEntropyFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& weight, const at::Tensor& target, GroupName group,
                            CrossEntropyOptions options, int64_t chunk_size,
                            at::ScalarType loss_dtype) {
    const at::Tensor h = as_2d(hidden).contiguous();
    const at::Tensor t = target.reshape({-1}).to(at::kLong).contiguous();
    auto [loss, lse, mask] = op::linear_cross_entropy_forward(
        h, weight, t, group, options.vocab_size, options.label_smoothing, options.ignore_index,
        options.z_loss, chunk_size);
    save_group(ctx, group);
    save_options(ctx, options);
    ctx->saved_data["chunk_size"] = chunk_size;
    ctx->saved_data["hidden_shape"] = c10::IValue(hidden.sym_sizes());
    ctx->save_for_backward({h, weight, t, lse, mask});
    return reduce_loss({loss, lse, mask}, options, target, loss_dtype);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& d = ctx->saved_data;
    const CrossEntropyOptions options = load_options(ctx);
    auto saved = ctx->get_saved_variables();
    const std::array<bool, 2> mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1)};
    auto [grad_hidden, grad_weight] = op::linear_cross_entropy_backward(
        saved[0], saved[1], saved[2], saved[3], loss_grad_scale(grads[0], saved[4], options),
        load_group(ctx), options.vocab_size, options.label_smoothing, options.z_loss,
        d["chunk_size"].toInt(), mask);
    const auto shape = d["hidden_shape"].toSymIntVector();
    return {mask[0] ? at::_unsafe_view_symint(grad_hidden, shape) : at::Tensor(),
            mask[1] ? grad_weight : at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_forward_kernel(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target, GroupName name,
    int64_t vocab_size, double label_smoothing, int64_t ignore_index, double z_loss,
    int64_t chunk_size) {
  const Group group = group_by_name(name);
  const CrossEntropyOptions options{vocab_size, label_smoothing, ignore_index, Reduction::None,
                                    z_loss};
  const at::Tensor h = hidden.contiguous();
  const at::Tensor t = target.to(at::kLong).contiguous();
  const VocabShard shard = vocab_shard(group, weight.size(0), vocab_size);
  const int64_t tokens = h.size(0);
  at::Tensor stats = at::empty({tokens, 4}, h.options().dtype(at::kFloat));
  for (int64_t c0 = 0; c0 < tokens; c0 += chunk_size) {
    const int64_t n = std::min(chunk_size, tokens - c0);
    const at::Tensor logits = chunk_logits(h.narrow(0, c0, n), weight);
    stats.narrow(0, c0, n).copy_(cross_entropy_stats(logits, t.narrow(0, c0, n), shard));
  }
  TokenLoss token = combine_cross_entropy_stats("vocab_parallel_linear_cross_entropy", stats, t,
                                                group, weight.size(0), options);
  return {token.loss, token.lse, token.mask};
}

std::tuple<at::Tensor, at::Tensor> linear_cross_entropy_backward_kernel(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
    const at::Tensor& lse, const at::Tensor& scale, GroupName name, int64_t vocab_size,
    double label_smoothing, double z_loss, int64_t chunk_size, std::array<bool, 2> mask) {
  const Group group = group_by_name(name);
  const CrossEntropyOptions options{vocab_size, label_smoothing, -100, Reduction::None, z_loss};
  const at::Tensor h = hidden.contiguous();
  const at::Tensor t = target.to(at::kLong).contiguous();
  const VocabShard shard = vocab_shard(group, weight.size(0), vocab_size);
  const int64_t tokens = h.size(0);
  // A masked-off gradient is an empty tensor of its own (outputs must not alias each other).
  const auto none = [&] { return at::empty({0}, h.options()); };
  at::Tensor grad_hidden = mask[0] ? at::empty_like(h) : none();
  // Accumulated over chunks in fp32 so low-precision weights lose nothing to it.
  at::Tensor grad_weight =
      mask[1] ? at::zeros(weight.sizes(), weight.options().dtype(at::kFloat)) : none();
  std::vector<PendingCollective> pending;
  for (int64_t c0 = 0; c0 < tokens; c0 += chunk_size) {
    const int64_t n = std::min(chunk_size, tokens - c0);
    const at::Tensor h_c = h.narrow(0, c0, n);
    at::Tensor logits = chunk_logits(h_c, weight);
    cross_entropy_grad(logits, t.narrow(0, c0, n), lse.narrow(0, c0, n), scale.narrow(0, c0, n),
                       logits, shard, options);
    if (mask[0]) {
      // hidden is replicated over TP: its gradient is the sum of every shard's part.
      // Each chunk's all-reduce runs while the next chunk is computed.
      at::Tensor part = grad_hidden.narrow(0, c0, n);
      at::mm_out(part, logits, weight);
      pending.push_back(all_reduce_inplace_async(part, group));
    }
    if (mask[1]) accumulate_weight_grad(grad_weight, logits, h_c);
  }
  for (auto& p : pending) p.wait();
  return {grad_hidden, mask[1] ? grad_weight.to(weight.scalar_type()) : none()};
}

at::Tensor vocab_parallel_linear_cross_entropy(const at::Tensor& hidden_, const at::Tensor& weight_,
                                               const at::Tensor& target, GroupName group,
                                               int64_t vocab_size, double label_smoothing,
                                               int64_t ignore_index, int64_t reduction,
                                               double z_loss, int64_t chunk_size) {
  const char* what = "vocab_parallel_linear_cross_entropy";
  // Under autocast: the head's GEMMs in the autocast dtype (as F.linear), the loss in fp32
  // (as F.cross_entropy).
  const auto autocast = autocast_dtype(hidden_);
  const at::Tensor hidden = autocast ? autocast_input(hidden_, *autocast) : hidden_;
  const at::Tensor weight = autocast ? autocast_input(weight_, *autocast) : weight_;
  const NoAutocast no_autocast;
  const int world = group_size(group_by_name(group));
  const auto dtype = hidden.scalar_type();
  check_loss_dtype(what, "hidden", dtype);
  TORCH_CHECK_TYPE(weight.scalar_type() == dtype, "tpcore: ", what, ": weight dtype ",
                   weight.scalar_type(), " does not match hidden dtype ", dtype);
  TORCH_CHECK_VALUE(
      weight.dim() == 2 && hidden.dim() >= 1 && holds(hidden.sym_size(-1) == weight.sym_size(1)),
      "tpcore: ", what,
      ": hidden [..., H] and weight [V_local, H] do not fit: ", hidden.sym_sizes(), " vs ",
      weight.sym_sizes());
  TORCH_CHECK_VALUE(weight.device() == hidden.device(), "tpcore: ", what, ": weight is on ",
                    weight.device(), " but hidden is on ", hidden.device());
  TORCH_CHECK_VALUE(chunk_size >= 1, "tpcore: ", what, ": chunk_size must be >= 1, got ",
                    chunk_size);
  const CrossEntropyOptions options =
      make_cross_entropy_options(what, vocab_size, concrete(weight.sym_size(0)), world,
                                 label_smoothing, ignore_index, reduction, z_loss);
  check_cross_entropy_args(what, target, hidden.sym_sizes().slice(0, hidden.dim() - 1),
                           hidden.device());
  return LinearCrossEntropyFn::apply(hidden, weight, target, group, options, chunk_size,
                                     autocast ? at::kFloat : dtype);
}

}  // namespace tpcore
