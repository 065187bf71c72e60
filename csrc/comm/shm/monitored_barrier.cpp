// torch.distributed.monitored_barrier on the shared-memory group, from point-to-point
// messages with a tag no torch caller can use (c10d's tags are 32-bit): every rank but 0
// tells rank 0 it has arrived, and waits for rank 0's release. Rank 0 waits for the others
// until the barrier's timeout; if any is missing it names it in torch's words and aborts
// the group, so every waiting rank raises at once with that reason.
#include <c10/util/Exception.h>

#include <sstream>
#include <vector>

#include "comm/shm/group.h"

namespace tpcore::shm {
namespace {

constexpr int64_t kArrivedTag = int64_t(1) << 40;
constexpr int64_t kReleasedTag = kArrivedTag + 1;

}  // namespace

void Group::monitored_barrier(std::chrono::milliseconds timeout, bool wait_all) {
  check_usable();
  if (world_ == 1) return;
  // Each message carries the barrier's number, so a message from an earlier, failed
  // barrier is never taken for this one's.
  const uint32_t number = ++monitored_barriers_;
  const auto start = Clock::now();
  const std::string ms = std::to_string(timeout.count());
  if (rank_ != 0) {
    // gloo's words for a rank that arrived but was not released (torch's tests match them)
    const std::string reached = "Rank " + std::to_string(rank_) +
                                " successfully reached monitoredBarrier, but received errors while "
                                "waiting for send/recv from rank 0. Please check rank 0 logs for "
                                "faulty rank.";
    send(reinterpret_cast<const char*>(&number), sizeof(number), 0, kArrivedTag);
    uint32_t released = 0;
    auto r = post_recv(reinterpret_cast<char*>(&released), sizeof(released), 0, kReleasedTag);
    bool in_time = false;
    try {
      // Rank 0 may arrive up to `timeout` late and then wait up to `timeout` for others.
      in_time = wait_recv_until(r, start + 2 * timeout + std::chrono::seconds(1),
                                "monitored_barrier (waiting for rank 0 to pass it)");
    } catch (const c10::DistBackendError& e) {  // rank 0 gave up (and said why) or died
      C10_THROW_ERROR(DistBackendError,
                      reached + "\n Original exception: \n" + e.what_without_backtrace());
    }
    if (!in_time) {
      cancel_recv(r);
      fail(reached + " (tpcore: rank 0 did not pass it within 2 x " + ms +
           " ms: rank 0 is late or stuck)");
    }
    TORCH_CHECK(released == number, "tpcore shm: monitored_barrier ", number,
                " was released by rank 0's barrier ", released);
    return;
  }
  std::vector<int> late;
  for (int peer = 1; peer < world_; ++peer) {
    // As gloo: a timeout spent before the next rank's turn is rank 0's own (when collecting
    // every late rank, it goes on: the waits below end at once).
    if (!wait_all && Clock::now() - start >= timeout)
      fail("Rank 0 timed out in monitoredBarrier after " + ms + " ms.");
    uint32_t arrived = 0;
    auto r = post_recv(reinterpret_cast<char*>(&arrived), sizeof(arrived), peer, kArrivedTag);
    if (!wait_recv_until(r, start + timeout,
                         "monitored_barrier (waiting for rank " + std::to_string(peer) + ")")) {
      cancel_recv(r);
      late.push_back(peer);
      if (!wait_all) break;
      continue;
    }
    TORCH_CHECK(arrived == number, "tpcore shm: monitored_barrier ", number, " met rank ", peer,
                "'s barrier ", arrived);
  }
  if (!late.empty()) {
    std::ostringstream why;
    why << "[Rank 0]: Rank" << (late.size() > 1 ? "s " : " ");
    for (size_t i = 0; i < late.size(); ++i) why << (i ? ", " : "") << late[i];
    why << " failed to pass monitoredBarrier in " << ms << " ms";
    fail(why.str());
  }
  for (int peer = 1; peer < world_; ++peer)
    send(reinterpret_cast<const char*>(&number), sizeof(number), peer, kReleasedTag);
}

}  // namespace tpcore::shm
