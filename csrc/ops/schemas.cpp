// tpcore's ops as PyTorch custom operators (TORCH_LIBRARY), so torch.compile, fake tensors
// and torch.export see them. Two kinds:
// - Primitives: collectives and the layers' fused forward / backward pieces. They have CPU
//   and CUDA kernels (ops/*_kernels.cpp) and fake implementations (tpcore/_fake_ops.py),
//   and are what compiled graphs contain. No autograd of their own.
// - Layer ops: the f / g mappings, the linear layers, embedding and losses. Their kernels are
//   CompositeImplicitAutograd (ops/composite_ops.cpp): a C++ autograd function whose
//   forward and backward call the primitives through the dispatcher.
// Process groups cross the op boundary by name (`group.group_name`), as torch's functional
// collectives do; the kernels resolve them with c10d::resolve_process_group.
#include <torch/library.h>

TORCH_LIBRARY(tpcore, m) {
  // Collectives: out of place, every output a fresh contiguous tensor.
  m.def("all_reduce(Tensor input, str group) -> Tensor");
  m.def("all_gather(Tensor input, int dim, str group) -> Tensor");
  m.def("reduce_scatter(Tensor input, int dim, str group) -> Tensor");
  m.def("broadcast(Tensor input, int src, str group) -> Tensor");
  m.def("split(Tensor input, int dim, str group) -> Tensor");
  // Started along dim 0, in flight until torch.ops._c10d_functional.wait_tensor(result).
  m.def("all_reduce_start(Tensor input, str group) -> Tensor");
  m.def("all_gather_start(Tensor input, str group) -> Tensor");
  m.def("reduce_scatter_start(Tensor input, str group) -> Tensor");

  // The layers' pieces. Masked-off gradients come back as empty [0] tensors.
  m.def(
      "column_parallel_linear_backward(Tensor grad_output, Tensor input, Tensor weight, str group, "
      "bool sequence_parallel, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  m.def(
      "row_parallel_linear_forward(Tensor input, Tensor weight, str group, bool sequence_parallel) "
      "-> Tensor");
  m.def(
      "vocab_parallel_embedding_forward(Tensor ids, Tensor weight, str group, int num_embeddings, "
      "bool sequence_parallel) -> Tensor");
  m.def(
      "vocab_parallel_embedding_backward(Tensor grad, Tensor ids, SymInt rows, int padding_idx, "
      "str group, bool sequence_parallel) -> Tensor");
  m.def(
      "cross_entropy_forward(Tensor logits, Tensor target, str group, int vocab_size, "
      "float label_smoothing, int ignore_index, float z_loss) -> (Tensor, Tensor, Tensor)");
  m.def(
      "cross_entropy_backward(Tensor logits, Tensor target, Tensor lse, Tensor scale, str group, "
      "int vocab_size, float label_smoothing, float z_loss) -> Tensor");
  m.def(
      "linear_cross_entropy_forward(Tensor hidden, Tensor weight, Tensor target, str group, "
      "int vocab_size, float label_smoothing, int ignore_index, float z_loss, int chunk_size) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "linear_cross_entropy_backward(Tensor hidden, Tensor weight, Tensor target, Tensor lse, "
      "Tensor scale, str group, int vocab_size, float label_smoothing, float z_loss, "
      "int chunk_size, bool[2] output_mask) -> (Tensor, Tensor)");
  // Counter-based dropout: the mask is a function of rng_state = (seed, offset) alone.
  m.def("dropout_apply(Tensor input, Tensor rng_state, float p) -> Tensor");
  // A copy of a stream's counter. Opaque on purpose: AOTAutograd's partitioner recomputes
  // a plain clone in backward from the graph input, which the graph has advanced by then.
  m.def("rng_state_copy(Tensor counter) -> Tensor");

  // Layer ops (autograd inside).
  m.def("copy_to_tensor_parallel(Tensor input, str group) -> Tensor");
  m.def("reduce_from_tensor_parallel(Tensor input, str group) -> Tensor");
  m.def("scatter_to_tensor_parallel(Tensor input, str group) -> Tensor");
  m.def("gather_from_tensor_parallel(Tensor input, str group) -> Tensor");
  m.def("scatter_to_sequence_parallel(Tensor input, str group) -> Tensor");
  m.def(
      "gather_from_sequence_parallel(Tensor input, str group, bool reduce_scatter_grad=True) "
      "-> Tensor");
  m.def("reduce_scatter_to_sequence_parallel(Tensor input, str group) -> Tensor");
  m.def("dropout(Tensor input, Tensor rng_state, float p) -> Tensor");
  m.def(
      "column_parallel_linear(Tensor input, Tensor weight, Tensor? bias, str group, "
      "bool gather_output=False, bool sequence_parallel=False) -> Tensor");
  m.def(
      "row_parallel_linear(Tensor input, Tensor weight, Tensor? bias, str group, "
      "bool input_is_parallel=True, bool sequence_parallel=False) -> Tensor");
  m.def(
      "vocab_parallel_embedding(Tensor ids, Tensor weight, str group, int num_embeddings, "
      "int padding_idx=-1, bool sequence_parallel=False) -> Tensor");
  m.def(
      "vocab_parallel_cross_entropy(Tensor logits, Tensor target, str group, int vocab_size=-1, "
      "float label_smoothing=0.0, int ignore_index=-100, int reduction=1, float z_loss=0.0, "
      "bool inplace_backward=False) -> Tensor");
  m.def(
      "vocab_parallel_linear_cross_entropy(Tensor hidden, Tensor weight, Tensor target, str group, "
      "int vocab_size=-1, float label_smoothing=0.0, int ignore_index=-100, int reduction=1, "
      "float z_loss=0.0, int chunk_size=4096) -> Tensor");
}
