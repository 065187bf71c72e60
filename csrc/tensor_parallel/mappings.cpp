// The f / g conjugate autograd functions of Megatron-LM (Shoeybi et al. 2019,
// section 3) and their scatter / gather / sequence-parallel cousins. Each is a
// pair (forward op, backward op) of communication primitives; backward is the
// conjugate of forward so that the composition is the gradient of the model.
// The primitives are tpcore's custom operators, called through the dispatcher.
#include <ATen/ATen.h>

#include "tensor_parallel/autograd_util.h"
#include "tensor_parallel/functions.h"

namespace tpcore {
namespace {

using CommOp = at::Tensor (*)(const at::Tensor&, GroupName);

at::Tensor identity(const at::Tensor& x, GroupName) { return x; }
at::Tensor sum(const at::Tensor& x, GroupName g) { return op::all_reduce(x, g); }
at::Tensor split_last(const at::Tensor& x, GroupName g) { return op::split(x, -1, g); }
at::Tensor gather_last(const at::Tensor& x, GroupName g) { return op::all_gather(x, -1, g); }
at::Tensor split_first(const at::Tensor& x, GroupName g) { return op::split(x, 0, g); }
at::Tensor gather_first(const at::Tensor& x, GroupName g) { return op::all_gather(x, 0, g); }
at::Tensor reduce_scatter_first(const at::Tensor& x, GroupName g) {
  return op::reduce_scatter(x, 0, g);
}

template <CommOp Forward, CommOp Backward>
struct Mapping : public torch::autograd::Function<Mapping<Forward, Backward>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, GroupName group) {
    save_group(ctx, group);
    return Forward(input, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor grad = grads[0].defined() ? Backward(grads[0], load_group(ctx)) : at::Tensor();
    return {grad, at::Tensor()};
  }
};

// f: identity forward, all-reduce backward (enters a tensor-parallel region).
using CopyToTensorParallel = Mapping<identity, sum>;
// g: all-reduce forward, identity backward (leaves a tensor-parallel region).
using ReduceFromTensorParallel = Mapping<sum, identity>;
using ScatterToTensorParallel = Mapping<split_last, gather_last>;
using GatherFromTensorParallel = Mapping<gather_last, split_last>;
using ScatterToSequenceParallel = Mapping<split_first, gather_first>;
using GatherFromSequenceParallel = Mapping<gather_first, reduce_scatter_first>;
using ReduceScatterToSequenceParallel = Mapping<reduce_scatter_first, gather_first>;
// For a consumer whose gradient is already summed over TP: backward keeps this rank's chunk.
using GatherFromSequenceParallelSplitGrad = Mapping<gather_first, split_first>;

// Every mapping is the identity on a group of one: no operator, no copy.
template <typename M>
at::Tensor apply(const at::Tensor& input, GroupName group) {
  if (group_size(group_by_name(group)) == 1) return input;
  return M::apply(input, group);
}

}  // namespace

at::Tensor copy_to_tensor_parallel(const at::Tensor& input, GroupName group) {
  return apply<CopyToTensorParallel>(input, group);
}
at::Tensor reduce_from_tensor_parallel(const at::Tensor& input, GroupName group) {
  return apply<ReduceFromTensorParallel>(input, group);
}
at::Tensor scatter_to_tensor_parallel(const at::Tensor& input, GroupName group) {
  return apply<ScatterToTensorParallel>(input, group);
}
at::Tensor gather_from_tensor_parallel(const at::Tensor& input, GroupName group) {
  return apply<GatherFromTensorParallel>(input, group);
}
at::Tensor scatter_to_sequence_parallel(const at::Tensor& input, GroupName group) {
  return apply<ScatterToSequenceParallel>(input, group);
}
at::Tensor gather_from_sequence_parallel(const at::Tensor& input, GroupName group,
                                         bool reduce_scatter_grad) {
  if (!reduce_scatter_grad) return apply<GatherFromSequenceParallelSplitGrad>(input, group);
  return apply<GatherFromSequenceParallel>(input, group);
}
at::Tensor reduce_scatter_to_sequence_parallel(const at::Tensor& input, GroupName group) {
  return apply<ReduceScatterToSequenceParallel>(input, group);
}

}  // namespace tpcore
