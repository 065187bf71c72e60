// The functional-collective form of tpcore's collectives, for traced graphs: `*_start`
// returns its result tensor at once, with the collective in flight on it, and
// torch.ops._c10d_functional.wait_tensor(result) waits for it (c10d's work registry ties the
// two, as torch's own functional collectives do). A compiled graph can then put computation
// between start and wait, as the column-parallel backward does with the weight gradient.
// On the shared-memory backend the collective completes inside start (nothing registered).
// torch before 2.6 may lack c10d::register_work (2.4 does): there start waits for the
// collective, so compiled graphs lose the overlap but not the result.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <torch/version.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "tensor_parallel/functions.h"

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 6)
#define TPCORE_HAVE_REGISTER_WORK 1
namespace c10d {
// Declared again here: its header moved between torch releases.
C10_EXPORT void register_work(const at::Tensor& tensor, const c10::intrusive_ptr<c10d::Work>& work);
}  // namespace c10d
#endif

namespace tpcore {
namespace {

at::Tensor started(PendingCollective pending) {
#ifdef TPCORE_HAVE_REGISTER_WORK
  if (auto out = pending.output()) {
    if (pending.work()) c10d::register_work(*out, pending.work());
    return *out;
  }
#endif
  return pending.wait();  // a fallback that finishes with a copy: done here, synchronously
}

at::Tensor all_reduce_start_kernel(const at::Tensor& input, GroupName group) {
  return started(
      all_reduce_inplace_async(input.clone(at::MemoryFormat::Contiguous), group_by_name(group)));
}

at::Tensor all_gather_start_kernel(const at::Tensor& input, GroupName name) {
  const Group group = group_by_name(name);
  if (group_size(group) == 1) return input.clone(at::MemoryFormat::Contiguous);
  return started(all_gather_async(input, 0, group));
}

at::Tensor reduce_scatter_start_kernel(const at::Tensor& input, GroupName name) {
  const Group group = group_by_name(name);
  if (group_size(group) == 1) return input.clone(at::MemoryFormat::Contiguous);
  return started(reduce_scatter_async(input, 0, group));
}

void register_started(torch::Library& m) {
  m.impl("all_reduce_start", all_reduce_start_kernel);
  m.impl("all_gather_start", all_gather_start_kernel);
  m.impl("reduce_scatter_start", reduce_scatter_start_kernel);
}

}  // namespace

TORCH_LIBRARY_IMPL(tpcore, CPU, m) { register_started(m); }
TORCH_LIBRARY_IMPL(tpcore, CUDA, m) { register_started(m); }

}  // namespace tpcore
