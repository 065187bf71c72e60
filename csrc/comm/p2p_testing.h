// Test hook for the pipeline p2p's coalescing (see p2p_testing.cpp).
#pragma once

#include <cstdint>
#include <string>

namespace tpcore {

struct CoalescingLog {
  int64_t starts = 0, ends = 0, sends = 0;
  std::string error;  // empty when the batch went through
};

// Sends `messages` tensors (each with its header) to rank 1 of a two-rank group whose CPU
// backend records coalescing and fails send number `fail_at_send` (1-based; 0: none), through
// the coalesced path of batch_isend_irecv. Returns what the backend saw and the error.
CoalescingLog coalesced_sends_for_test(int64_t messages, int64_t fail_at_send);

}  // namespace tpcore
