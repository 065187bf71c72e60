// The f / g conjugate autograd functions of Megatron-LM (Shoeybi et al. 2019,
// section 3) and their scatter / gather / sequence-parallel cousins. Each is a
// pair (forward op, backward op) of communication primitives; backward is the
// conjugate of forward so that the composition is the gradient of the model.
#include <ATen/ATen.h>

#include "tensor_parallel/autograd_util.h"
#include "tensor_parallel/ops.h"

namespace tpcore {
namespace {

using CommOp = at::Tensor (*)(const at::Tensor&, const Group&);

at::Tensor identity(const at::Tensor& x, const Group&) { return x; }
at::Tensor split_last(const at::Tensor& x, const Group& g) { return split_along_dim(x, -1, g); }
at::Tensor gather_last(const at::Tensor& x, const Group& g) { return all_gather(x, -1, g); }
at::Tensor split_first(const at::Tensor& x, const Group& g) { return split_along_dim(x, 0, g); }
at::Tensor gather_first(const at::Tensor& x, const Group& g) { return all_gather(x, 0, g); }
at::Tensor reduce_scatter_first(const at::Tensor& x, const Group& g) {
  return reduce_scatter(x, 0, g);
}

template <CommOp Forward, CommOp Backward>
struct Mapping : public torch::autograd::Function<Mapping<Forward, Backward>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const Group& group) {
    save_group(ctx, group);
    return Forward(input, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor grad = grads[0].defined() ? Backward(grads[0], load_group(ctx)) : at::Tensor();
    return {grad, at::Tensor()};
  }
};

// f: identity forward, all-reduce backward (enters a tensor-parallel region).
using CopyToTensorParallel = Mapping<identity, all_reduce>;
// g: all-reduce forward, identity backward (leaves a tensor-parallel region).
using ReduceFromTensorParallel = Mapping<all_reduce, identity>;
using ScatterToTensorParallel = Mapping<split_last, gather_last>;
using GatherFromTensorParallel = Mapping<gather_last, split_last>;
using ScatterToSequenceParallel = Mapping<split_first, gather_first>;
using GatherFromSequenceParallel = Mapping<gather_first, reduce_scatter_first>;
using ReduceScatterToSequenceParallel = Mapping<reduce_scatter_first, gather_first>;
// For a consumer whose gradient is already summed over TP: backward keeps this rank's chunk.
using GatherFromSequenceParallelSplitGrad = Mapping<gather_first, split_first>;

}  // namespace

at::Tensor copy_to_tensor_parallel(const at::Tensor& input, const Group& group) {
  return CopyToTensorParallel::apply(input, group);
}
at::Tensor reduce_from_tensor_parallel(const at::Tensor& input, const Group& group) {
  return ReduceFromTensorParallel::apply(input, group);
}
at::Tensor scatter_to_tensor_parallel(const at::Tensor& input, const Group& group) {
  return ScatterToTensorParallel::apply(input, group);
}
at::Tensor gather_from_tensor_parallel(const at::Tensor& input, const Group& group) {
  return GatherFromTensorParallel::apply(input, group);
}
at::Tensor scatter_to_sequence_parallel(const at::Tensor& input, const Group& group) {
  return ScatterToSequenceParallel::apply(input, group);
}
at::Tensor gather_from_sequence_parallel(const at::Tensor& input, const Group& group,
                                         bool reduce_scatter_grad) {
  if (!reduce_scatter_grad) return GatherFromSequenceParallelSplitGrad::apply(input, group);
  return GatherFromSequenceParallel::apply(input, group);
}
at::Tensor reduce_scatter_to_sequence_parallel(const at::Tensor& input, const Group& group) {
  return ReduceScatterToSequenceParallel::apply(input, group);
}

}  // namespace tpcore
