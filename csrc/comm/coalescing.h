// A coalescing group (NCCL's ncclGroupStart / ncclGroupEnd) that is always closed.
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/util/Exception.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace tpcore {

// Opens the group's coalescing on `type` when constructed; end() closes it and returns the
// work of the whole batch. If end() is never reached (a send or receive threw in between),
// the destructor closes it, so the backend is not left inside an open group where every
// later collective of the process would hang.
class CoalescingGuard {
 public:
  CoalescingGuard(const c10::intrusive_ptr<c10d::ProcessGroup>& group, c10::DeviceType type)
      : group_(group), type_(type) {
    group_->startCoalescing(type_);
    open_ = true;
  }
  CoalescingGuard(const CoalescingGuard&) = delete;
  CoalescingGuard& operator=(const CoalescingGuard&) = delete;

  c10::intrusive_ptr<c10d::Work> end() {
    TORCH_CHECK(open_, "tpcore: pipeline: coalescing group already closed");
    open_ = false;
    return group_->endCoalescing(type_);
  }

  ~CoalescingGuard() {
    if (!open_) return;
    try {
      // The messages posted so far are issued and their work dropped: the error that
      // unwinds the stack is the one to report.
      group_->endCoalescing(type_);
    } catch (...) {
    }
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  c10::DeviceType type_;
  bool open_ = false;
};

}  // namespace tpcore
