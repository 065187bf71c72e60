// Collectives on a c10d::ProcessGroup, issued from C++.
//
// Every function takes the group explicitly. Functions named *_async return a
// PendingCollective so the caller can overlap computation with communication
// and wait as late as correctness allows. A group of size 1 makes every
// collective a no-op that returns its input (possibly the same tensor).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <c10/util/string_view.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

// Declared only: <torch/csrc/distributed/c10d/ProcessGroup.hpp> costs ~15 s of parsing in
// every file that includes it, and most users of this header only pass groups along. Files
// that call into a group (group->...) include it themselves.
namespace c10d {
class ProcessGroup;
class Work;
}  // namespace c10d

namespace tpcore {

// A shared reference to a c10d::ProcessGroup: an intrusive_ptr whose copy, move and
// destruction are defined in comm.cpp (where ProcessGroup is complete), so it can be held
// and passed where ProcessGroup is only declared. Converts to and from the intrusive_ptr.
class Group {
 public:
  Group() noexcept;
  Group(c10::intrusive_ptr<c10d::ProcessGroup> group) noexcept;  // NOLINT: implicit on purpose
  Group(const Group& other) noexcept;
  Group(Group&& other) noexcept;
  Group& operator=(const Group& other) noexcept;
  Group& operator=(Group&& other) noexcept;
  ~Group();

  c10d::ProcessGroup* get() const noexcept { return ptr_.get(); }
  c10d::ProcessGroup* operator->() const noexcept { return ptr_.get(); }
  c10d::ProcessGroup& operator*() const noexcept { return *ptr_.get(); }
  explicit operator bool() const noexcept { return ptr_.defined(); }
  const c10::intrusive_ptr<c10d::ProcessGroup>& ptr() const noexcept { return ptr_; }
  operator const c10::intrusive_ptr<c10d::ProcessGroup>&() const noexcept { return ptr_; }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> ptr_;
};

// A collective in flight. wait() blocks until it is done and returns its result. Its special
// members are defined in comm.cpp, where c10d::Work is complete.
class PendingCollective {
 public:
  PendingCollective() noexcept;
  PendingCollective(c10::intrusive_ptr<c10d::Work> work, std::function<at::Tensor()> finish);
  // A collective whose result is `output` itself once `work` completes (no finishing step).
  PendingCollective(c10::intrusive_ptr<c10d::Work> work, at::Tensor output);
  // A collective that needed no communication (e.g. a group of size 1).
  explicit PendingCollective(at::Tensor done);
  PendingCollective(const PendingCollective& other);
  PendingCollective(PendingCollective&& other) noexcept;
  PendingCollective& operator=(const PendingCollective& other);
  PendingCollective& operator=(PendingCollective&& other) noexcept;
  ~PendingCollective();

  at::Tensor wait();
  // Whether wait() would return without blocking.
  bool is_completed() const;
  // The tensor wait() will return, when it is known before the work completes (the
  // collective writes into it); nullopt when a finishing step builds it.
  std::optional<at::Tensor> output() const {
    return known_ ? std::optional<at::Tensor>(result_) : std::nullopt;
  }
  // The work in flight (null when there is none or it was waited on).
  const c10::intrusive_ptr<c10d::Work>& work() const { return work_; }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<at::Tensor()> finish_;
  at::Tensor result_;
  bool known_ = false;
  bool waited_ = false;
};

// The group registered under `name` (torch.distributed registers every group it creates;
// Python passes `group.group_name`). A clear error when there is none.
Group group_by_name(c10::string_view name);

int group_size(const Group& group);
int group_rank(const Group& group);

// Sum over the group into `tensor` itself. A non-contiguous tensor is reduced
// through a contiguous copy that is copied back, so nothing is silently skipped.
PendingCollective all_reduce_inplace_async(at::Tensor tensor, const Group& group);
// Out-of-place sum over the group; `input` is left untouched.
at::Tensor all_reduce(const at::Tensor& input, const Group& group);

// Concatenation of every rank's `input` along `dim`, in group-rank order.
PendingCollective all_gather_async(const at::Tensor& input, int64_t dim, const Group& group);
at::Tensor all_gather(const at::Tensor& input, int64_t dim, const Group& group);

// Sum over the group, then this rank keeps chunk `rank` of `dim`
// (size of `dim` must be divisible by the group size).
PendingCollective reduce_scatter_async(const at::Tensor& input, int64_t dim, const Group& group);
at::Tensor reduce_scatter(const at::Tensor& input, int64_t dim, const Group& group);
// The fallback used where a backend has no reduce-scatter: all-reduce, keep a chunk.
at::Tensor reduce_scatter_via_all_reduce(const at::Tensor& input, int64_t dim, const Group& group);

// Copy of `src_rank`'s tensor (rank within `group`) on every rank; out of place.
at::Tensor broadcast(const at::Tensor& input, int64_t src_rank, const Group& group);

// The (backend/collective/dtype/device) combinations routed to a fallback because the
// backend lacks them; mark_collective_missing adds (or with missing=false removes) one:
// tests use it to stand in for a backend without the collective.
std::vector<std::string> collective_fallbacks();
void mark_collective_missing(const Group& group, const std::string& op, const at::Tensor& like,
                             bool missing);

// This rank's chunk of `input` along `dim` (no communication; contiguous copy).
at::Tensor split_along_dim(const at::Tensor& input, int64_t dim, const Group& group);

}  // namespace tpcore
