// Column- and row-parallel linear layers as C++ autograd functions.
//
// Column: W is [out/tp, in]. Forward needs no communication (the input enters
// through f, or is all-gathered along the sequence with sequence parallelism);
// backward all-reduces (or reduce-scatters) the input gradient, issued
// asynchronously and overlapped with the weight-gradient GEMM.
// Row: W is [out, in/tp]. Forward sums the partial outputs (g), or
// reduce-scatters them along the sequence; the bias is added after the sum.
#include <ATen/ATen.h>

#include "tensor_parallel/autocast_util.h"
#include "tensor_parallel/autograd_util.h"
#include "tensor_parallel/functions.h"

namespace tpcore {
namespace {

void check_linear_args(const char* layer, const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, const c10::SymInt& expected_bias,
                       const Group& group) {
  TORCH_CHECK_VALUE(group, "tpcore: ", layer, ": process group is null");
  TORCH_CHECK_VALUE(weight.dim() == 2, "tpcore: ", layer, ": weight must be 2-D, got shape ",
                    weight.sym_sizes());
  TORCH_CHECK_VALUE(input.dim() >= 1, "tpcore: ", layer, ": input must have at least 1 dim");
  TORCH_CHECK_VALUE(holds(input.sym_size(-1) == weight.sym_size(1)), "tpcore: ", layer,
                    ": input has last dim ", input.sym_size(-1),
                    " but the layer's weight shard expects ", weight.sym_size(1), " (input shape ",
                    input.sym_sizes(), ", weight shape ", weight.sym_sizes(), ")");
  TORCH_CHECK_TYPE(at::isFloatingType(input.scalar_type()), "tpcore: ", layer,
                   ": input must be a floating-point tensor, got ", input.scalar_type());
  TORCH_CHECK_TYPE(input.scalar_type() == weight.scalar_type(), "tpcore: ", layer, ": input dtype ",
                   input.scalar_type(), " does not match weight dtype ", weight.scalar_type());
  TORCH_CHECK_VALUE(input.device() == weight.device(), "tpcore: ", layer, ": input is on ",
                    input.device(), " but the weight is on ", weight.device());
  if (bias && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && holds(bias->sym_size(0) == expected_bias),
                      "tpcore: ", layer, ": bias must have shape [", expected_bias, "], got ",
                      bias->sym_sizes());
    TORCH_CHECK_TYPE(bias->scalar_type() == weight.scalar_type(), "tpcore: ", layer,
                     ": bias dtype ", bias->scalar_type(), " does not match weight dtype ",
                     weight.scalar_type());
    TORCH_CHECK_VALUE(bias->device() == weight.device(), "tpcore: ", layer, ": bias is on ",
                      bias->device(), " but the weight is on ", weight.device());
  }
}

void check_sequence_dim(const char* layer, const at::Tensor& t, const Group& group) {
  const int world = group_size(group);
  TORCH_CHECK_VALUE(t.dim() >= 2 && holds(t.sym_size(0) % world == 0), "tpcore: ", layer,
                    ": with sequence parallelism dim 0 (sequence) of shape ", t.sym_sizes(),
                    " must be divisible by the tensor-parallel size ", world);
}

// The column-parallel backward in functional-collective form, for traced graphs: the
// input-gradient collective is started, the weight gradient computed, then the collective
// waited for, so the compiled graph keeps the overlap the eager kernel has.
std::tuple<at::Tensor, at::Tensor, at::Tensor> traced_backward(
    const at::Tensor& grad_, const at::Tensor& input, const at::Tensor& weight, GroupName group,
    bool sequence_parallel, std::array<bool, 3> mask) {
  const at::Tensor grad = grad_.contiguous();
  // The whole sequence is gathered again only for the weight gradient (none: a frozen weight).
  const bool gather = sequence_parallel && mask[1];
  at::Tensor total_input = gather ? op::all_gather_start(input, group) : input;
  at::Tensor grad_input;
  if (mask[0]) {
    const at::Tensor partial = grad.matmul(weight);
    grad_input = sequence_parallel ? op::reduce_scatter_start(partial, group)
                                   : op::all_reduce_start(partial, group);
  }
  if (gather) total_input = op::wait_tensor(total_input);
  const at::Tensor grad_2d = as_2d(grad);
  at::Tensor grad_weight, grad_bias;
  if (mask[1]) grad_weight = grad_2d.t().mm(as_2d(total_input));
  if (mask[2]) grad_bias = grad_2d.sum(0);
  if (mask[0]) grad_input = op::wait_tensor(grad_input);
  return {grad_input, grad_weight, grad_bias};
}

struct ColumnParallelLinearFn : public torch::autograd::Function<ColumnParallelLinearFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, GroupName group,
                            bool sequence_parallel) {
    save_group(ctx, group);
    ctx->saved_data["sequence_parallel"] = sequence_parallel;
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    // With sequence parallelism only the local sequence shard is saved; backward
    // gathers it again rather than keeping the full [seq, batch, in] activation.
    ctx->save_for_backward({input, weight});
    at::Tensor total_input = sequence_parallel ? op::all_gather(input, 0, group) : input;
    return at::linear(total_input, weight, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const std::array<bool, 3> mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                   has_bias && ctx->needs_input_grad(2)};
    const std::string group = load_group(ctx);
    const bool sequence_parallel = ctx->saved_data["sequence_parallel"].toBool();
    auto [grad_input, grad_weight, grad_bias] =
        is_traced(grads[0])
            ? traced_backward(grads[0], saved[0], saved[1], group, sequence_parallel, mask)
            : op::column_parallel_linear_backward(grads[0], saved[0], saved[1], group,
                                                  sequence_parallel, mask);
    return {mask[0] ? grad_input : at::Tensor(), mask[1] ? grad_weight : at::Tensor(),
            mask[2] ? grad_bias : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct RowParallelLinearFn : public torch::autograd::Function<RowParallelLinearFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            GroupName group, bool sequence_parallel) {
    save_group(ctx, group);
    ctx->saved_data["sequence_parallel"] = sequence_parallel;
    ctx->save_for_backward({input, weight});
    return op::row_parallel_linear_forward(input, weight, group, sequence_parallel);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const std::string group = load_group(ctx);
    auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    at::Tensor grad_output = grads[0].contiguous();
    if (ctx->saved_data["sequence_parallel"].toBool())
      grad_output = op::all_gather(grad_output, 0, group);
    at::Tensor grad_input, grad_weight;
    if (ctx->needs_input_grad(0)) grad_input = grad_output.matmul(weight);
    if (ctx->needs_input_grad(1)) grad_weight = as_2d(grad_output).t().mm(as_2d(input));
    return {grad_input, grad_weight, at::Tensor(), at::Tensor()};
  }
};

// Under torch.autocast a linear computes in the autocast dtype, as nn.Linear does there.
struct LinearInputs {
  at::Tensor input, weight;
  std::optional<at::Tensor> bias;
};

LinearInputs autocast_linear_inputs(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias) {
  const auto dtype = autocast_dtype(input);
  if (!dtype) return {input, weight, bias};
  std::optional<at::Tensor> cast_bias = bias;
  if (bias && bias->defined()) cast_bias = autocast_input(*bias, *dtype);
  return {autocast_input(input, *dtype), autocast_input(weight, *dtype), cast_bias};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> column_parallel_linear_backward_kernel(
    const at::Tensor& grad, const at::Tensor& input, const at::Tensor& weight, GroupName name,
    bool sequence_parallel, std::array<bool, 3> mask) {
  const Group group = group_by_name(name);
  const at::Tensor grad_output = grad.contiguous();
  // The whole sequence is gathered again only for the weight gradient (none: a frozen weight).
  PendingCollective gathered_input =
      sequence_parallel && mask[1] ? all_gather_async(input, 0, group) : PendingCollective(input);
  // Issue the input-gradient reduction first, then compute the weight gradient while it
  // is in flight.
  PendingCollective grad_input;
  if (mask[0]) {
    at::Tensor partial = grad_output.matmul(weight);
    grad_input = sequence_parallel ? reduce_scatter_async(partial, 0, group)
                                   : all_reduce_inplace_async(partial, group);
  }
  // A masked-off gradient is an empty tensor of its own (outputs must not alias each other).
  const auto none = [&] { return at::empty({0}, grad.options()); };
  at::Tensor grad_weight = none(), grad_bias = none();
  const at::Tensor total_input = gathered_input.wait();
  const at::Tensor grad_2d = as_2d(grad_output);
  if (mask[1]) grad_weight = grad_2d.t().mm(as_2d(total_input));
  if (mask[2]) grad_bias = grad_2d.sum(0);
  return {mask[0] ? grad_input.wait() : none(), grad_weight, grad_bias};
}

at::Tensor row_parallel_linear_forward_kernel(const at::Tensor& input, const at::Tensor& weight,
                                              GroupName name, bool sequence_parallel) {
  const Group group = group_by_name(name);
  at::Tensor partial = at::matmul(input, weight.t());
  if (sequence_parallel) return reduce_scatter(partial, 0, group).contiguous();
  // `partial` is a fresh temporary: sum it in place, no extra copy.
  return all_reduce_inplace_async(partial, group).wait().contiguous();
}

at::Tensor column_parallel_linear(const at::Tensor& input_, const at::Tensor& weight_,
                                  const std::optional<at::Tensor>& bias_, GroupName group,
                                  bool gather_output, bool sequence_parallel) {
  const char* layer = "ColumnParallelLinear";
  const auto [input, weight, bias] = autocast_linear_inputs(input_, weight_, bias_);
  const NoAutocast no_autocast;
  check_linear_args(layer, input, weight, bias, weight.sym_size(0), group_by_name(group));
  TORCH_CHECK_VALUE(!(gather_output && sequence_parallel), "tpcore: ", layer,
                    ": gather_output=True cannot be combined with sequence_parallel=True");
  if (sequence_parallel)
    TORCH_CHECK_VALUE(input.dim() >= 2, "tpcore: ", layer,
                      ": sequence parallelism needs a [seq, ...] input");
  // The function's backward is f's all-reduce (or the sequence-parallel reduce-scatter),
  // fused with the GEMMs so it overlaps the weight gradient.
  at::Tensor out = ColumnParallelLinearFn::apply(input, weight, bias, group, sequence_parallel);
  return gather_output ? gather_from_tensor_parallel(out, group) : out;
}

at::Tensor row_parallel_linear(const at::Tensor& input_, const at::Tensor& weight_,
                               const std::optional<at::Tensor>& bias_, GroupName name,
                               bool input_is_parallel, bool sequence_parallel) {
  const char* layer = "RowParallelLinear";
  const auto [input, weight, bias] = autocast_linear_inputs(input_, weight_, bias_);
  const NoAutocast no_autocast;
  const Group group = group_by_name(name);
  const int world = group_size(group);
  TORCH_CHECK_VALUE(input_is_parallel || !sequence_parallel, "tpcore: ", layer,
                    ": sequence_parallel=True needs input_is_parallel=True");
  // A full (unsplit) input has world times the shard's features.
  if (!input_is_parallel) {
    TORCH_CHECK_VALUE(input.dim() >= 1 && holds(input.sym_size(-1) == weight.sym_size(1) * world),
                      "tpcore: ", layer, ": input has last dim ", input.sym_size(-1),
                      " but in_features is ", weight.sym_size(1) * world,
                      " (input_is_parallel=False)");
  }
  at::Tensor x = input_is_parallel ? input : scatter_to_tensor_parallel(input, name);
  check_linear_args(layer, x, weight, bias, weight.sym_size(0), group);
  if (sequence_parallel) check_sequence_dim(layer, x, group);
  at::Tensor out = RowParallelLinearFn::apply(x, weight, name, sequence_parallel);
  if (bias && bias->defined()) {
    // The replicated bias is added to this rank's rows only: with sequence parallelism each
    // rank sees its sequence shard, so the bias gradient is summed over TP (f's backward).
    out = out + (sequence_parallel ? copy_to_tensor_parallel(*bias, name) : *bias);
  }
  return out;
}

}  // namespace tpcore
