// Point-to-point messages between pipeline stages, issued from C++ on the pipeline
// c10d::ProcessGroup, and the backward of an activation whose storage was released.
//
// A batch posts every send and receive before waiting on any of them, so two stages
// that exchange in both directions at once (send forward + receive backward) cannot
// deadlock on gloo; on NCCL the batch is one coalesced group. Within a batch, sends
// and receives are issued sorted by (peer, tag), so both ends of a link issue their
// messages in the same order (NCCL matches a pair's messages in issue order).
//
// The receiver knows the shape it expects (from the model config). With
// check_shapes, every payload is preceded by a fixed-size header naming the sender's
// dtype and shape, exchanged as a first round of the batch: a mismatch is a
// ValueError naming the message and both shapes, raised before any payload moves
// (gloo would abort the process on a larger payload, NCCL would hang or corrupt).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

#include "comm/comm.h"

namespace tpcore {

// A tensor for group rank `peer`. `what` names the message in errors.
struct P2PSend {
  at::Tensor tensor;
  int64_t peer;
  int64_t tag;
  std::string what;
};

// A tensor of a known shape from group rank `peer`.
struct P2PRecv {
  std::vector<int64_t> shape;
  int64_t peer;
  int64_t tag;
  std::string what;
};

// Posts all `sends` and `recvs` (group ranks, tags >= 0 and < 2^16), waits for all of
// them, and returns the received tensors (dtype, device as given) in `recvs` order.
std::vector<at::Tensor> batch_isend_irecv(const Group& group, const std::vector<P2PSend>& sends,
                                          const std::vector<P2PRecv>& recvs, at::ScalarType dtype,
                                          at::Device device, bool check_shapes);

// batch_isend_irecv with the batch coalesced on `coalesce_on` (the NCCL path: one group,
// headers checked after it) or not (std::nullopt: the gloo path). batch_isend_irecv picks
// CUDA for CUDA tensors; tests run the coalesced path on the CPU with a recording backend.
std::vector<at::Tensor> batch_isend_irecv_on(const Group& group, const std::vector<P2PSend>& sends,
                                             const std::vector<P2PRecv>& recvs,
                                             at::ScalarType dtype, at::Device device,
                                             bool check_shapes,
                                             std::optional<c10::DeviceType> coalesce_on);

// Replaces the storage of an activation that has been sent by a 1-element tensor, so
// that holding it as the root of a later backward costs no memory (Megatron's
// deallocate_output_tensor). Views are left alone: their base would stay alive anyway.
// Returns whether the storage was released.
bool release_storage(const at::Tensor& tensor);

// Backward from `output` with gradient `grad` (ones when absent), accumulating into
// the leaves' .grad; works when `output`'s storage was released, because the engine
// checks `grad` against the shape recorded when `output` was created.
void backward_from(const at::Tensor& output, const std::optional<at::Tensor>& grad);

}  // namespace tpcore
