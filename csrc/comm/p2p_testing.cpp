// Test hook: the coalesced (NCCL) path of batch_isend_irecv run on the CPU against a backend
// that records coalescing and fails the n-th send, to check that the group is always closed.
#include "comm/p2p_testing.h"

#include <ATen/ATen.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "comm/p2p.h"

namespace tpcore {
namespace {

class DoneWork : public c10d::Work {
 public:
  bool wait(std::chrono::milliseconds) override { return true; }
};

class RecordingBackend : public c10d::Backend {
 public:
  explicit RecordingBackend(int64_t fail_at_send) : Backend(0, 2), fail_at_send_(fail_at_send) {}
  const std::string getBackendName() const override { return "tpcore-recording"; }
  void startCoalescing() override { ++log.starts; }
  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    ++log.ends;
    return c10::make_intrusive<DoneWork>();
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>&, int, int) override {
    TORCH_CHECK(++log.sends != fail_at_send_, "tpcore test backend: send ", log.sends, " failed");
    return c10::make_intrusive<DoneWork>();
  }
  CoalescingLog log;

 private:
  int64_t fail_at_send_;
};

}  // namespace

CoalescingLog coalesced_sends_for_test(int64_t messages, int64_t fail_at_send) {
  auto backend = c10::make_intrusive<RecordingBackend>(fail_at_send);
  auto group = c10::make_intrusive<c10d::ProcessGroup>(0, 2);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, backend);
  std::vector<P2PSend> sends;
  for (int64_t i = 0; i < messages; ++i) sends.push_back({at::ones({4}), 1, i, "message"});
  try {
    batch_isend_irecv_on(group, sends, {}, at::kFloat, at::Device(at::kCPU), /*check_shapes=*/true,
                         c10::DeviceType::CPU);
  } catch (const c10::Error& e) {
    backend->log.error = e.what_without_backtrace();
  }
  return backend->log;
}

}  // namespace tpcore
