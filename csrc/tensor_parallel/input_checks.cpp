#include "tensor_parallel/input_checks.h"

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "kernels/kernels.h"

namespace tpcore {
namespace {

bool enabled_from_env() {
  const char* v = std::getenv("TPCORE_CHECK_INPUTS");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

std::atomic<bool> enabled{enabled_from_env()};

}  // namespace

void set_input_checks(bool on) { enabled.store(on, std::memory_order_relaxed); }

bool input_checks_enabled() { return enabled.load(std::memory_order_relaxed); }

bool should_check_values(const at::Tensor& t) {
  if (!input_checks_enabled()) return false;
#ifdef TPCORE_WITH_CUDA
  if (t.is_cuda() && cuda_stream_capturing(t.device())) return false;
#endif
  return true;
}

std::string ranks_where(const at::Tensor& column) {
  std::string out;
  for (int64_t r = 0; r < column.size(0); ++r)
    if (column[r].item<double>() != 0) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

}  // namespace tpcore
