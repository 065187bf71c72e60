#include "comm/comm.h"

#include <ATen/ATen.h>
#include <c10/core/WrapDimMinimal.h>

#include <mutex>
#include <set>
#include <string>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "comm/shm/backend.h"

// _allgather_base / _reduce_scatter_base are deprecated aliases in new torch but
// the only spelling that exists across every torch we support (>= 2.4).
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace tpcore {
namespace {

bool is_unsupported_error(const c10::Error& e) {
  const std::string msg = e.what_without_backtrace();
  return msg.find("does not support") != std::string::npos ||
         msg.find("not supported") != std::string::npos ||
         msg.find("not implemented") != std::string::npos;
}

// The name of the backend that serves `t`'s device in `g` ("gloo", "tpcore", "nccl"); the
// group's own name says only "custom" for a registered backend.
std::string backend_name(const Group& g, const at::Tensor& t) {
  try {
    return g->getBackend(t.device().type())->getBackendName();
  } catch (const c10::Error&) {
    return g->getBackendName();
  }
}

// (backend, collective, dtype, device) combinations found unsupported, remembered so the
// unsupported call is attempted once per process, not once per step. Keyed that finely so
// that one failure (say gloo's reduce-scatter of one dtype) never sends other dtypes or
// operations down the slower fallback.
class MissingOps {
 public:
  bool lacks(const Group& g, const char* op, const at::Tensor& t) {
    std::lock_guard<std::mutex> lock(mu_);
    return missing_.count(key(g, op, t)) > 0;
  }
  void mark(const Group& g, const char* op, const at::Tensor& t, bool missing = true) {
    std::lock_guard<std::mutex> lock(mu_);
    if (missing) {
      missing_.insert(key(g, op, t));
    } else {
      missing_.erase(key(g, op, t));
    }
  }
  std::vector<std::string> list() {
    std::lock_guard<std::mutex> lock(mu_);
    return {missing_.begin(), missing_.end()};
  }

 private:
  static std::string key(const Group& g, const char* op, const at::Tensor& t) {
    return backend_name(g, t) + "/" + op + "/" + std::string(c10::toString(t.scalar_type())) + "/" +
           c10::DeviceTypeName(t.device().type(), /*lower_case=*/true);
  }
  std::mutex mu_;
  std::set<std::string> missing_;
};

MissingOps& missing_ops() {
  static MissingOps ops;
  return ops;
}

void check_group(const Group& group) { TORCH_CHECK_VALUE(group, "tpcore: process group is null"); }

// `dim` of `input` wrapped to be non-negative, after checking it splits into `world` chunks.
int64_t divisible_dim(const char* op, const at::Tensor& input, int64_t dim, int world) {
  dim = c10::maybe_wrap_dim(dim, input.dim());
  TORCH_CHECK_VALUE(input.size(dim) % world == 0, "tpcore: ", op, ": size ", input.size(dim),
                    " of dim ", dim, " is not divisible by the group size ", world);
  return dim;
}

// Stacks the group-size chunks of `input` along `dim` as a contiguous [world, ...] buffer,
// the layout the single-tensor collectives use.
at::Tensor chunks_to_front(const at::Tensor& input, int64_t dim, int world) {
  if (dim == 0) return input.contiguous();
  return at::stack(input.chunk(world, dim), 0).contiguous();
}

// A [world, ...] gather buffer as every rank's piece concatenated along `dim`.
at::Tensor concat_gathered(const at::Tensor& buffer, int64_t dim) {
  return dim == 0 ? buffer.flatten(0, 1) : at::cat(buffer.unbind(0), dim);
}

}  // namespace

Group::Group() noexcept = default;
Group::Group(c10::intrusive_ptr<c10d::ProcessGroup> group) noexcept : ptr_(std::move(group)) {}
Group::Group(const Group& other) noexcept = default;
Group::Group(Group&& other) noexcept = default;
Group& Group::operator=(const Group& other) noexcept = default;
Group& Group::operator=(Group&& other) noexcept = default;
Group::~Group() = default;

PendingCollective::PendingCollective() noexcept = default;
PendingCollective::PendingCollective(c10::intrusive_ptr<c10d::Work> work,
                                     std::function<at::Tensor()> finish)
    : work_(std::move(work)), finish_(std::move(finish)) {}
PendingCollective::PendingCollective(c10::intrusive_ptr<c10d::Work> work, at::Tensor output)
    : work_(std::move(work)), result_(std::move(output)), known_(true) {}
PendingCollective::PendingCollective(at::Tensor done) : result_(std::move(done)), known_(true) {
  waited_ = true;
}
PendingCollective::PendingCollective(const PendingCollective& other) = default;
PendingCollective::PendingCollective(PendingCollective&& other) noexcept = default;
PendingCollective& PendingCollective::operator=(const PendingCollective& other) = default;
PendingCollective& PendingCollective::operator=(PendingCollective&& other) noexcept = default;
PendingCollective::~PendingCollective() = default;

bool PendingCollective::is_completed() const { return waited_ || !work_ || work_->isCompleted(); }

at::Tensor PendingCollective::wait() {
  if (!waited_) {
    if (work_) work_->wait();
    if (!known_) result_ = finish_ ? finish_() : at::Tensor();
    work_.reset();
    finish_ = nullptr;
    waited_ = true;
  }
  return result_;
}

Group group_by_name(c10::string_view name) {
  const std::string key(name);
  try {
    return c10d::resolve_process_group(key);
  } catch (const c10::Error&) {
    TORCH_CHECK_VALUE(false, "tpcore: no process group is registered under the name '", key,
                      "' (pass group.group_name of a torch.distributed group, after "
                      "init_process_group / new_group)");
  }
}

int group_size(const Group& group) {
  check_group(group);
  return group->getSize();
}

int group_rank(const Group& group) {
  check_group(group);
  return group->getRank();
}

PendingCollective all_reduce_inplace_async(at::Tensor tensor, const Group& group) {
  if (group_size(group) == 1) return PendingCollective(tensor);
  // Reducing a contiguous copy and copying back keeps non-contiguous inputs correct.
  at::Tensor buffer = tensor.is_contiguous() ? tensor : tensor.contiguous();
  if (auto* shm = shm::ShmBackend::of(group, buffer); shm && shm->all_reduce_sum(buffer)) {
    if (!buffer.is_same(tensor)) tensor.copy_(buffer);
    return PendingCollective(tensor);
  }
  std::vector<at::Tensor> tensors{buffer};
  auto work = group->allreduce(tensors);
  if (buffer.is_same(tensor)) return PendingCollective(work, tensor);
  return PendingCollective(work, [tensor, buffer]() mutable {
    if (!buffer.is_same(tensor)) tensor.copy_(buffer);
    return tensor;
  });
}

at::Tensor all_reduce(const at::Tensor& input, const Group& group) {
  if (group_size(group) == 1) return input;
  return all_reduce_inplace_async(input.clone(at::MemoryFormat::Contiguous), group).wait();
}

PendingCollective all_gather_async(const at::Tensor& input, int64_t dim, const Group& group) {
  const int world = group_size(group);
  // A 0-d tensor gathers like a 1-element vector: [world] (as all_gather_into_tensor does).
  if (input.dim() == 0) return all_gather_async(input.reshape({1}), 0, group);
  dim = c10::maybe_wrap_dim(dim, input.dim());
  if (world == 1) return PendingCollective(input);
  at::Tensor local = input.contiguous();
  std::vector<int64_t> buffer_shape{world};
  buffer_shape.insert(buffer_shape.end(), local.sizes().begin(), local.sizes().end());
  at::Tensor buffer = at::empty(buffer_shape, local.options());

  if (auto* shm = shm::ShmBackend::of(group, local)) {
    shm->all_gather(buffer.view({-1}), local.view({-1}));
    return PendingCollective(concat_gathered(buffer, dim));
  }
  c10::intrusive_ptr<c10d::Work> work;
  if (!missing_ops().lacks(group, "allgather_base", input)) {
    try {
      at::Tensor flat = buffer.view({-1});
      at::Tensor flat_in = local.view({-1});
      work = group->_allgather_base(flat, flat_in);
    } catch (const c10::Error& e) {
      if (!is_unsupported_error(e)) throw;
      missing_ops().mark(group, "allgather_base", input);
    }
  }
  if (!work) {
    std::vector<std::vector<at::Tensor>> outputs{buffer.unbind(0)};
    std::vector<at::Tensor> inputs{local};
    work = group->allgather(outputs, inputs);
  }
  if (dim == 0) return PendingCollective(work, concat_gathered(buffer, 0));  // a view of it
  return PendingCollective(work, [buffer, dim]() { return concat_gathered(buffer, dim); });
}

at::Tensor all_gather(const at::Tensor& input, int64_t dim, const Group& group) {
  return all_gather_async(input, dim, group).wait();
}

at::Tensor reduce_scatter_via_all_reduce(const at::Tensor& input, int64_t dim, const Group& group) {
  const int world = group_size(group);
  dim = divisible_dim("reduce_scatter", input, dim, world);
  return all_reduce(input, group).chunk(world, dim)[group_rank(group)].contiguous();
}

PendingCollective reduce_scatter_async(const at::Tensor& input, int64_t dim, const Group& group) {
  const int world = group_size(group);
  dim = divisible_dim("reduce_scatter", input, dim, world);
  if (world == 1) return PendingCollective(input);
  if (!missing_ops().lacks(group, "reduce_scatter_base", input)) {
    at::Tensor stacked = chunks_to_front(input, dim, world);
    auto out_shape = input.sizes().vec();
    out_shape[dim] /= world;
    at::Tensor out = at::empty(out_shape, input.options());
    if (auto* shm = shm::ShmBackend::of(group, stacked);
        shm && shm->reduce_scatter_sum(out.view({-1}), stacked.view({-1})))
      return PendingCollective(out);
    try {
      at::Tensor flat_out = out.view({-1});
      at::Tensor flat_in = stacked.view({-1});
      auto work = group->_reduce_scatter_base(flat_out, flat_in);
      return PendingCollective(work, out);
    } catch (const c10::Error& e) {
      if (!is_unsupported_error(e)) throw;
      missing_ops().mark(group, "reduce_scatter_base", input);
    }
  }
  return PendingCollective(reduce_scatter_via_all_reduce(input, dim, group));
}

at::Tensor reduce_scatter(const at::Tensor& input, int64_t dim, const Group& group) {
  return reduce_scatter_async(input, dim, group).wait();
}

at::Tensor broadcast(const at::Tensor& input, int64_t src_rank, const Group& group) {
  const int world = group_size(group);
  TORCH_CHECK_VALUE(src_rank >= 0 && src_rank < world, "tpcore: broadcast: source rank ", src_rank,
                    " is outside the group of size ", world);
  if (world == 1) return input;
  std::vector<at::Tensor> tensors{input.clone(at::MemoryFormat::Contiguous)};
  if (auto* shm = shm::ShmBackend::of(group, tensors[0])) {
    shm->broadcast(tensors[0], static_cast<int>(src_rank));
    return tensors[0];
  }
  c10d::BroadcastOptions opts;
  opts.rootRank = src_rank;
  group->broadcast(tensors, opts)->wait();
  return tensors[0];
}

at::Tensor split_along_dim(const at::Tensor& input, int64_t dim, const Group& group) {
  const int world = group_size(group);
  dim = divisible_dim("split", input, dim, world);
  if (world == 1) return input;
  return input.chunk(world, dim)[group_rank(group)].contiguous();
}

std::vector<std::string> collective_fallbacks() { return missing_ops().list(); }

void mark_collective_missing(const Group& group, const std::string& op, const at::Tensor& like,
                             bool missing) {
  missing_ops().mark(group, op.c_str(), like, missing);
}

}  // namespace tpcore
