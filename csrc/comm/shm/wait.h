// Waiting on a 32-bit word in shared memory, written so that more ranks than cores never
// livelock: spin briefly (only when every rank has a core), then yield, then sleep in a
// futex that the writer wakes (it makes the system call only when someone sleeps).
#pragma once

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>

namespace tpcore::shm {

using Clock = std::chrono::steady_clock;

void futex_wake_all(std::atomic<uint32_t>* word);
// Sleeps while *word == expected, at most `timeout` (spurious wake-ups are fine).
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::microseconds timeout);
// False when process `pid` has exited or is a zombie (same host).
bool process_alive(int pid);
// Online CPUs this process may run on.
int usable_cpus();

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// A word that peers wait on, with a count of its sleepers so that publishing is a plain
// store unless somebody sleeps. Each lives on its own cache line.
struct alignas(64) WaitWord {
  std::atomic<uint32_t> value;
  alignas(64) std::atomic<uint32_t> sleepers;
  char pad[60];

  // seq_cst on both sides (here and in wait_until) so a sleeper either sees the new value
  // or is seen and woken.
  void publish(uint32_t v) {
    value.store(v, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(&value);
  }
  // For a word several ranks write (a doorbell): any change wakes the sleepers.
  void bump() {
    value.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(&value);
  }
};

struct WaitPolicy {
  int spin_iters = 2000;                        // busy polls before yielding
  std::chrono::microseconds yield_for{1000};    // then yield for this long
  std::chrono::microseconds sleep_slice{2000};  // then futex sleeps of this length
  std::chrono::milliseconds check_every{20};    // how often `check` runs once yielding
};

// Returns once ready(word.value) holds. While waiting past the spin phase, calls
// check(elapsed) every policy.check_every; check throws to give up (timeout, dead peer).
template <class Ready, class Check>
void wait_until(WaitWord& word, Ready ready, const WaitPolicy& policy, Check check) {
  if (ready(word.value.load(std::memory_order_acquire))) return;
  for (int i = 0; i < policy.spin_iters; ++i) {
    cpu_relax();
    if (ready(word.value.load(std::memory_order_acquire))) return;
  }
  const auto start = Clock::now();
  auto next_check = start + policy.check_every;
  while (true) {
    const auto now = Clock::now();
    if (now - start < policy.yield_for) {
      sched_yield();
    } else {
      word.sleepers.fetch_add(1, std::memory_order_seq_cst);
      const uint32_t v = word.value.load(std::memory_order_seq_cst);
      if (!ready(v)) futex_wait(&word.value, v, policy.sleep_slice);
      word.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
    if (ready(word.value.load(std::memory_order_acquire))) return;
    const auto after = Clock::now();
    if (after >= next_check) {
      check(after - start);
      next_check = after + policy.check_every;
    }
  }
}

}  // namespace tpcore::shm
