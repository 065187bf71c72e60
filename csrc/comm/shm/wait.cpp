#include "comm/shm/wait.h"

#include <linux/futex.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>

namespace tpcore::shm {

// Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::microseconds timeout) {
  timespec ts{};
  ts.tv_sec = timeout.count() / 1000000;
  ts.tv_nsec = (timeout.count() % 1000000) * 1000;
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

bool process_alive(int pid) {
  if (pid <= 0) return true;  // unknown: assume alive, the timeout still applies
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  // A killed child whose parent has not reaped it yet is a zombie: dead for our purposes.
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return true;  // no /proc (or another PID namespace): rely on kill() and the timeout
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  // The state follows the last ')' (the command name may contain spaces and parentheses).
  const char* p = nullptr;
  for (const char* q = buf; *q; ++q)
    if (*q == ')') p = q;
  if (!p || !p[1] || !p[2]) return true;
  return p[2] != 'Z' && p[2] != 'X';
}

int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  const long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

}  // namespace tpcore::shm
