// The `tpcore` c10d backend: collectives and point-to-point messages through shared
// memory among the ranks of a group on one host (group.h), and an internal gloo backend
// for everything else (other operations, dtypes and reduce ops), made on first use.
// Registered from Python by `import tpcore` (tpcore/_shm_backend.py).
//
// Fast operations run in the calling thread and return completed work; so `wait()` is
// free and `get_future()` is ready. Errors (a mismatched call, a dead or late peer) raise
// from the call itself.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/shm/group.h"

namespace tpcore::shm {

class ShmBackend : public c10d::Backend {
 public:
  using Fallback = std::function<c10::intrusive_ptr<c10d::Backend>()>;
  // Runs a function with the GIL released when the calling thread holds it (bindings.cpp).
  using WithoutGil = std::function<void(const std::function<void()>&)>;

  // Collective over the group (every rank constructs it): rank 0 creates the segment and
  // passes its name through `store`. `make_fallback` builds the gloo backend on first use.
  ShmBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, const Config& config,
             Fallback make_fallback, WithoutGil without_gil);
  ~ShmBackend() override;

  const std::string getBackendName() const override { return "tpcore"; }
  // Its timeout, where torch and tpcore look for a group's settings (e.g. to give the
  // groups made from a `tpcore` default group the same timeout).
  c10::intrusive_ptr<Options> getBackendOptions() override {
    return c10::make_intrusive<Options>(getBackendName(), timeout_);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;
  // c10d's sequence number: collectives issued on this group so far (the same on every
  // rank of a group in step; torch reads it to check that). Setting it is a no-op: it
  // starts at 0 on every rank, as in torch since 2.12.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return seq_.load(); }

  // The shared-memory backend serving `t`'s device in `pg`, or null (tpcore's collectives
  // call it directly: the same work without c10d's dispatch, Work and future per call).
  static ShmBackend* of(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const at::Tensor& t);
  // Direct forms of the fast ops for contiguous CPU tensors (see Group); false when `t`'s
  // dtype has no shared-memory path, so the caller goes through c10d instead.
  bool all_reduce_sum(const at::Tensor& t);
  void all_gather(const at::Tensor& out, const at::Tensor& in);
  bool reduce_scatter_sum(const at::Tensor& out, const at::Tensor& in);
  void broadcast(const at::Tensor& t, int root);

  // Counts of operations that took the shared-memory path and the gloo path (tests, benchmarks).
  int64_t fast_ops() const { return fast_ops_; }
  int64_t fallback_ops() const { return fallback_ops_; }
  const std::string& segment_name() const { return group_->segment_name(); }

 private:
  c10d::Backend& fallback();
  // The gloo fallback for a collective, after one shared-memory step in which every rank
  // checks that the others called the same operation (Group::agree_on).
  c10d::Backend& gloo(OpCode op, const std::vector<at::Tensor>& tensors, int64_t root = 0,
                      std::optional<c10d::ReduceOp> reduce_op = std::nullopt);
  c10::intrusive_ptr<c10d::Work> allgather_base(at::Tensor& output, at::Tensor& input,
                                                const c10d::AllgatherOptions& opts);
  c10::intrusive_ptr<c10d::Work> reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                     const c10d::ReduceScatterOptions& opts);
  c10::intrusive_ptr<c10d::Work> done(std::vector<at::Tensor> result, c10d::OpType op);

  std::unique_ptr<Group> group_;
  std::chrono::milliseconds timeout_;
  Fallback make_fallback_;
  WithoutGil without_gil_;
  c10::intrusive_ptr<c10d::Backend> fallback_;
  std::mutex fallback_mu_;
  std::atomic<int64_t> fast_ops_{0}, fallback_ops_{0};
  std::atomic<uint64_t> seq_{0};
};

}  // namespace tpcore::shm
