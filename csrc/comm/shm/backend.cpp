#include "comm/shm/backend.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <optional>
#include <thread>
#include <type_traits>

namespace tpcore::shm {
namespace {

using c10d::OpType;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// The op types of the tensor-coalesced collectives; c10d before torch 2.5 has only COALESCED.
template <typename T, typename = void>
struct CoalescedOpTypes {
  static constexpr T all_gather = T::COALESCED;
  static constexpr T reduce_scatter = T::COALESCED;
};
template <typename T>
struct CoalescedOpTypes<T, std::void_t<decltype(T::ALLGATHER_INTO_TENSOR_COALESCED)>> {
  static constexpr T all_gather = T::ALLGATHER_INTO_TENSOR_COALESCED;
  static constexpr T reduce_scatter = T::REDUCE_SCATTER_TENSOR_COALESCED;
};

std::optional<ReduceKind> kind_of(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return ReduceKind::kSum;
    case c10d::ReduceOp::AVG:
      return ReduceKind::kAvg;
    case c10d::ReduceOp::MAX:
      return ReduceKind::kMax;
    case c10d::ReduceOp::MIN:
      return ReduceKind::kMin;
    case c10d::ReduceOp::PRODUCT:
      return ReduceKind::kProduct;
    default:
      return std::nullopt;
  }
}

// Tensors the shared-memory path can move: dense, on the CPU, of a fixed-size dtype.
bool movable(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided && !t.is_quantized();
}

bool movable(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts)
    if (!movable(t)) return false;
  return true;
}

// Byte counts and offsets of an all_to_all with split sizes along dim 0.
struct SplitBytes {
  std::vector<int64_t> send, send_at, recv, recv_at;
};

// Counts and offsets of one side: `splits` rows of `row` bytes each (empty: equal parts of
// `rows`); nullopt when they do not describe the tensor.
std::optional<std::pair<std::vector<int64_t>, std::vector<int64_t>>> side(
    const std::vector<int64_t>& splits, int64_t rows, int64_t row, int world) {
  std::vector<int64_t> counts(world), offsets(world);
  if (splits.empty() && rows % world != 0) return std::nullopt;
  if (!splits.empty() && static_cast<int>(splits.size()) != world) return std::nullopt;
  int64_t at = 0;
  for (int r = 0; r < world; ++r) {
    const int64_t n = splits.empty() ? rows / world : splits[r];
    if (n < 0) return std::nullopt;
    offsets[r] = at * row;
    counts[r] = n * row;
    at += n;
  }
  if (at != rows) return std::nullopt;
  return std::make_pair(counts, offsets);
}

// The bytes each rank sends and receives, or nullopt for tensors and splits the shared-memory
// path does not take (gloo then raises c10d's error, or runs them).
std::optional<SplitBytes> uneven_split_bytes(const at::Tensor& output, const at::Tensor& input,
                                             const std::vector<int64_t>& output_splits,
                                             const std::vector<int64_t>& input_splits, int world) {
  if (!movable(output) || !movable(input) || input.dim() == 0 || output.dim() == 0 ||
      output.scalar_type() != input.scalar_type())
    return std::nullopt;
  const int64_t es = input.element_size();
  const int64_t in_row = input.numel() / std::max<int64_t>(input.size(0), 1) * es;
  const int64_t out_row = output.numel() / std::max<int64_t>(output.size(0), 1) * es;
  // Rows of both must be alike (c10d's rule), unless a side has no rows to tell.
  if (input.size(0) > 0 && output.size(0) > 0 && in_row != out_row) return std::nullopt;
  const int64_t row = input.size(0) > 0 ? in_row : out_row;
  auto sent = side(input_splits, input.size(0), row, world);
  auto received = side(output_splits, output.size(0), row, world);
  if (!sent || !received) return std::nullopt;
  return SplitBytes{sent->first, sent->second, received->first, received->second};
}

// Runs `fn` on a contiguous tensor with `t`'s data, and copies back into `t` when that
// had to be a copy (so non-contiguous inputs and outputs work).
template <class Fn>
void on_contiguous(const at::Tensor& t, bool copy_in, Fn fn) {
  if (t.is_contiguous()) {
    fn(t);
    return;
  }
  at::Tensor c = copy_in ? t.contiguous() : at::empty(t.sizes(), t.options());
  fn(c);
  t.copy_(c);
}

// The work of an operation already done: nothing to wait for; the future is made only
// when asked for (DDP's hooks do, tpcore's paths never).
class DoneWork : public c10d::Work {
 public:
  DoneWork(int rank, OpType op, std::vector<at::Tensor> result)
      : c10d::Work(rank, op), result_(std::move(result)) {
    finish();
  }
  bool isCompleted() override { return true; }
  bool wait(std::chrono::milliseconds) override { return true; }
  std::vector<at::Tensor> result() override { return result_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto fut =
        c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    fut->markCompleted(c10::IValue(result_));
    return fut;
  }

 private:
  std::vector<at::Tensor> result_;
};

// A send or receive in flight: wait() completes it once (`complete`); its result is `user`.
class P2PWork : public c10d::Work {
 public:
  P2PWork(c10::intrusive_ptr<c10d::Backend> owner, Group* group, OpType op, at::Tensor user)
      : c10d::Work(group->rank(), op),
        owner_(std::move(owner)),
        group_(group),
        user_(std::move(user)) {}

  bool wait(std::chrono::milliseconds) override {
    std::lock_guard<std::mutex> lock(wait_mu_);
    if (!done_) {
      complete();
      done_ = true;
      finish();
    }
    return true;
  }
  bool isCompleted() override { return done_; }
  std::vector<at::Tensor> result() override { return {user_}; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    wait(std::chrono::milliseconds(0));
    auto fut =
        c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    fut->markCompleted(c10::IValue(std::vector<at::Tensor>{user_}));
    return fut;
  }

 protected:
  virtual void complete() = 0;

  c10::intrusive_ptr<c10d::Backend> owner_;  // keeps the group mapped
  Group* group_;
  at::Tensor user_;
  std::mutex wait_mu_;
  bool done_ = false;
};

// A receive in flight: wait() reads it from the link (see Group::wait_recv) into the user's
// tensor (through a contiguous buffer when it is not contiguous).
class RecvWork : public P2PWork {
 public:
  RecvWork(c10::intrusive_ptr<c10d::Backend> owner, Group* group, std::shared_ptr<Group::Recv> recv,
           at::Tensor user, at::Tensor buffer)
      : P2PWork(std::move(owner), group, OpType::RECV, std::move(user)),
        recv_(std::move(recv)),
        buffer_(std::move(buffer)) {}
  int sourceRank() const override { return recv_->src; }

 private:
  void complete() override {
    group_->wait_recv(recv_);
    if (!user_.is_same(buffer_)) user_.copy_(buffer_);
  }
  std::shared_ptr<Group::Recv> recv_;
  at::Tensor buffer_;
};

// A send whose message did not fit in the link at once: its rest is written as the peer
// drains the link, at the latest in wait().
class SendWork : public P2PWork {
 public:
  SendWork(c10::intrusive_ptr<c10d::Backend> owner, Group* group, std::shared_ptr<Group::Send> sent,
           at::Tensor user)
      : P2PWork(std::move(owner), group, OpType::SEND, std::move(user)), sent_(std::move(sent)) {}
  bool isCompleted() override { return done_ || group_->push_sends(sent_.get()); }

 private:
  void complete() override { group_->wait_send(sent_); }
  std::shared_ptr<Group::Send> sent_;
};

}  // namespace

ShmBackend::ShmBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       const Config& config, Fallback make_fallback, WithoutGil without_gil)
    : c10d::Backend(rank, size),
      timeout_(config.timeout),
      make_fallback_(std::move(make_fallback)),
      without_gil_(std::move(without_gil)) {
  const std::string name_key = "tpcore_shm/segment", mapped_key = "tpcore_shm/mapped";
  // A rank that gives up on making the group leaves its reason here (tpcore/shm.py too).
  const std::string abandoned_key = "tpcore_shm/abandoned";
  auto wait_for_name = [&]() {
    // Polled with the group's timeout: a blocking get would wait for the store's own (5 to
    // 30 min), after rank 0 has long given up.
    const auto deadline = Clock::now() + config.timeout;
    while (!store->check({name_key})) {
      if (store->check({abandoned_key})) {
        const auto why = store->get(abandoned_key);
        C10_THROW_ERROR(DistBackendError, "tpcore shm: rank " + std::to_string(rank) +
                                              ": a rank gave up making this group: " +
                                              std::string(why.begin(), why.end()));
      }
      if (Clock::now() > deadline)
        C10_THROW_ERROR(DistBackendError,
                        "tpcore shm: rank " + std::to_string(rank) + ": Timed out after " +
                            std::to_string(config.timeout.count()) +
                            " ms waiting for rank 0 to create the group's shared memory (is it "
                            "stuck, or did it make the group with other ranks?)");
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    const auto v = store->get(name_key);
    return std::string(v.begin(), v.end());
  };
  try {
    group_ = std::make_unique<Group>(
        rank, size, config,
        [&](const std::string& name) {
          store->set(name_key, std::vector<uint8_t>(name.begin(), name.end()));
        },
        wait_for_name, [&]() { store->add(mapped_key, 1); },
        [&]() {
          const auto deadline = Clock::now() + config.timeout;
          while (store->add(mapped_key, 0) < size) {
            TORCH_CHECK(Clock::now() < deadline,
                        "tpcore shm: ranks did not map the segment within ", config.timeout.count(),
                        " ms");
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
          }
        });
  } catch (const std::exception& e) {
    if (rank == 0 && !store->check({name_key})) {  // the others would wait for its name
      const std::string why = e.what();
      store->set(abandoned_key, std::vector<uint8_t>(why.begin(), why.end()));
    }
    throw;
  }
}

ShmBackend::~ShmBackend() {
  // gloo's destructor joins its worker threads, which may need the GIL to drop the last
  // reference to a Python-owned tensor of a finished operation: without releasing it here
  // (when the caller holds it) that was a deadlock at destroy_process_group.
  if (fallback_) without_gil_([this] { fallback_.reset(); });
}

c10d::Backend& ShmBackend::gloo(OpCode op, const std::vector<at::Tensor>& tensors, int64_t root,
                                std::optional<c10d::ReduceOp> reduce_op) {
  // The same numbers on every rank whose call matches: the first tensor's dtype, the
  // elements of all of them (unknown for all_to_all, whose sizes may differ by rank).
  uint64_t numel = 0;
  for (const auto& t : tensors) numel += t.numel();
  const int64_t reduce = reduce_op ? static_cast<int64_t>(reduce_op->op_) : 0;
  group_->agree_on(OpHeader{static_cast<uint32_t>(op),
                            tensors.empty() ? 0u : static_cast<uint32_t>(tensors[0].scalar_type()),
                            numel, 1000 * reduce + root, 0, 1});
  return fallback();
}

c10d::Backend& ShmBackend::fallback() {
  std::lock_guard<std::mutex> lock(fallback_mu_);
  if (!fallback_) fallback_ = make_fallback_();
  ++fallback_ops_;
  return *fallback_;
}

WorkPtr ShmBackend::done(std::vector<at::Tensor> result, OpType op) {
  ++fast_ops_;
  return c10::make_intrusive<DoneWork>(getRank(), op, std::move(result));
}

ShmBackend* ShmBackend::of(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const at::Tensor& t) {
  if (!pg || !movable(t)) return nullptr;
  try {
    return dynamic_cast<ShmBackend*>(pg->getBackend(t.device().type()).get());
  } catch (const c10::Error&) {
    return nullptr;  // no backend for this device
  }
}

bool ShmBackend::all_reduce_sum(const at::Tensor& t) {
  ++seq_;
  if (!reducible(t.scalar_type(), ReduceKind::kSum)) return false;
  group_->all_reduce(t, ReduceKind::kSum);
  ++fast_ops_;
  return true;
}

void ShmBackend::all_gather(const at::Tensor& out, const at::Tensor& in) {
  ++seq_;
  group_->all_gather(out, in);
  ++fast_ops_;
}

bool ShmBackend::reduce_scatter_sum(const at::Tensor& out, const at::Tensor& in) {
  ++seq_;
  if (!reducible(in.scalar_type(), ReduceKind::kSum)) return false;
  group_->reduce_scatter(out, in, ReduceKind::kSum);
  ++fast_ops_;
  return true;
}

void ShmBackend::broadcast(const at::Tensor& t, int root) {
  ++seq_;
  group_->broadcast(t, root);
  ++fast_ops_;
}

WorkPtr ShmBackend::broadcast(std::vector<at::Tensor>& tensors,
                              const c10d::BroadcastOptions& opts) {
  ++seq_;
  if (tensors.size() != 1 || !movable(tensors) || opts.rootTensor != 0)
    return gloo(OpCode::kBroadcast, tensors, opts.rootRank).broadcast(tensors, opts);
  on_contiguous(tensors[0], true, [&](const at::Tensor& t) {
    group_->broadcast(t, static_cast<int>(opts.rootRank));
  });
  return done(tensors, OpType::BROADCAST);
}

WorkPtr ShmBackend::allreduce(std::vector<at::Tensor>& tensors,
                              const c10d::AllreduceOptions& opts) {
  ++seq_;
  const auto kind = kind_of(opts.reduceOp);
  if (tensors.size() != 1 || !movable(tensors) || !kind ||
      !reducible(tensors[0].scalar_type(), *kind))
    return gloo(OpCode::kAllReduce, tensors, 0, opts.reduceOp).allreduce(tensors, opts);
  on_contiguous(tensors[0], true, [&](const at::Tensor& t) { group_->all_reduce(t, *kind); });
  return done(tensors, OpType::ALLREDUCE);
}

WorkPtr ShmBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                        const c10d::AllreduceCoalescedOptions& opts) {
  ++seq_;
  const auto kind = kind_of(opts.reduceOp);
  bool fast = movable(tensors) && kind.has_value();
  for (const auto& t : tensors) fast = fast && reducible(t.scalar_type(), *kind);
  if (!fast)
    return gloo(OpCode::kAllReduce, tensors, 0, opts.reduceOp).allreduce_coalesced(tensors, opts);
  for (auto& t : tensors)
    on_contiguous(t, true, [&](const at::Tensor& c) { group_->all_reduce(c, *kind); });
  return done(tensors, OpType::ALLREDUCE_COALESCED);
}

WorkPtr ShmBackend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  ++seq_;
  return gloo(OpCode::kReduce, tensors, opts.rootRank, opts.reduceOp).reduce(tensors, opts);
}

WorkPtr ShmBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                    const c10d::AllgatherOptions& opts) {
  ++seq_;
  return allgather_base(output, input, opts);
}

WorkPtr ShmBackend::allgather_base(at::Tensor& output, at::Tensor& input,
                                   const c10d::AllgatherOptions& opts) {
  if (!movable(output) || !movable(input))
    return gloo(OpCode::kAllGather, {input})._allgather_base(output, input, opts);
  TORCH_CHECK_VALUE(output.scalar_type() == input.scalar_type(),
                    "tpcore shm: all_gather: output is ", output.scalar_type(), " but input is ",
                    input.scalar_type());
  TORCH_CHECK_VALUE(output.numel() == input.numel() * getSize(),
                    "tpcore shm: all_gather: output has ", output.numel(), " elements, expected ",
                    getSize(), " x ", input.numel());
  const at::Tensor in = input.contiguous();
  on_contiguous(output, false, [&](const at::Tensor& out) { group_->all_gather(out, in); });
  return done({output}, OpType::_ALLGATHER_BASE);
}

WorkPtr ShmBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                              std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  ++seq_;
  if (inputs.size() != 1 || outputs.size() != 1 || !movable(inputs) || !movable(outputs[0]))
    return gloo(OpCode::kAllGather, inputs).allgather(outputs, inputs, opts);
  auto& outs = outputs[0];
  TORCH_CHECK_VALUE(static_cast<int>(outs.size()) == getSize(),
                    "tpcore shm: all_gather: ", outs.size(), " output tensors for a group of ",
                    getSize());
  for (const auto& o : outs)
    TORCH_CHECK_VALUE(o.numel() == inputs[0].numel() && o.scalar_type() == inputs[0].scalar_type(),
                      "tpcore shm: all_gather: every output must match the input (",
                      inputs[0].numel(), " x ", inputs[0].scalar_type(), ")");
  at::Tensor flat = at::empty({getSize() * inputs[0].numel()}, inputs[0].options());
  group_->all_gather(flat, inputs[0].contiguous());
  for (int r = 0; r < getSize(); ++r)
    outs[r].copy_(flat.narrow(0, r * inputs[0].numel(), inputs[0].numel()).view(outs[r].sizes()));
  return done(outs, OpType::ALLGATHER);
}

WorkPtr ShmBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::AllgatherOptions& opts) {
  ++seq_;
  return gloo(OpCode::kAllGather, inputs).allgather_coalesced(outputs, inputs, opts);
}

WorkPtr ShmBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                    std::vector<at::Tensor>& inputs,
                                                    const c10d::AllgatherOptions& opts) {
  ++seq_;
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "tpcore shm: all_gather: ", outputs.size(),
                    " outputs for ", inputs.size(), " inputs");
  for (size_t i = 0; i < inputs.size(); ++i) allgather_base(outputs[i], inputs[i], opts);
  return done(outputs, CoalescedOpTypes<OpType>::all_gather);
}

WorkPtr ShmBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                           std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  ++seq_;
  return gloo(OpCode::kGather, inputs, opts.rootRank).gather(outputs, inputs, opts);
}

WorkPtr ShmBackend::scatter(std::vector<at::Tensor>& outputs,
                            std::vector<std::vector<at::Tensor>>& inputs,
                            const c10d::ScatterOptions& opts) {
  ++seq_;
  return gloo(OpCode::kScatter, outputs, opts.rootRank).scatter(outputs, inputs, opts);
}

WorkPtr ShmBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                         const c10d::ReduceScatterOptions& opts) {
  ++seq_;
  return reduce_scatter_base(output, input, opts);
}

WorkPtr ShmBackend::reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                        const c10d::ReduceScatterOptions& opts) {
  const auto kind = kind_of(opts.reduceOp);
  if (!movable(output) || !movable(input) || !kind || !reducible(input.scalar_type(), *kind))
    return gloo(OpCode::kReduceScatter, {output}, 0, opts.reduceOp)
        ._reduce_scatter_base(output, input, opts);
  TORCH_CHECK_VALUE(output.scalar_type() == input.scalar_type(),
                    "tpcore shm: reduce_scatter: output is ", output.scalar_type(),
                    " but input is ", input.scalar_type());
  TORCH_CHECK_VALUE(input.numel() == output.numel() * getSize(),
                    "tpcore shm: reduce_scatter: input has ", input.numel(), " elements, expected ",
                    getSize(), " x ", output.numel());
  const at::Tensor in = input.contiguous();
  on_contiguous(output, false,
                [&](const at::Tensor& out) { group_->reduce_scatter(out, in, *kind); });
  return done({output}, OpType::_REDUCE_SCATTER_BASE);
}

WorkPtr ShmBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                   std::vector<std::vector<at::Tensor>>& inputs,
                                   const c10d::ReduceScatterOptions& opts) {
  ++seq_;
  const auto kind = kind_of(opts.reduceOp);
  if (outputs.size() != 1 || inputs.size() != 1 || !movable(outputs) || !movable(inputs[0]) ||
      !kind || !reducible(outputs[0].scalar_type(), *kind))
    return gloo(OpCode::kReduceScatter, outputs, 0, opts.reduceOp)
        .reduce_scatter(outputs, inputs, opts);
  TORCH_CHECK_VALUE(static_cast<int>(inputs[0].size()) == getSize(),
                    "tpcore shm: reduce_scatter: ", inputs[0].size(),
                    " input tensors for a group of ", getSize());
  std::vector<at::Tensor> flat_parts;
  for (const auto& t : inputs[0]) {
    TORCH_CHECK_VALUE(
        t.numel() == outputs[0].numel() && t.scalar_type() == outputs[0].scalar_type(),
        "tpcore shm: reduce_scatter: every input must match the output (", outputs[0].numel(),
        " x ", outputs[0].scalar_type(), ")");
    flat_parts.push_back(t.reshape({-1}));
  }
  const at::Tensor in = at::cat(flat_parts);
  on_contiguous(outputs[0], false,
                [&](const at::Tensor& out) { group_->reduce_scatter(out, in, *kind); });
  return done(outputs, OpType::REDUCE_SCATTER);
}

WorkPtr ShmBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                    std::vector<at::Tensor>& inputs,
                                                    const c10d::ReduceScatterOptions& opts) {
  ++seq_;
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "tpcore shm: reduce_scatter: ", outputs.size(),
                    " outputs for ", inputs.size(), " inputs");
  for (size_t i = 0; i < inputs.size(); ++i) reduce_scatter_base(outputs[i], inputs[i], opts);
  return done(outputs, CoalescedOpTypes<OpType>::reduce_scatter);
}

WorkPtr ShmBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                  std::vector<int64_t>& output_splits,
                                  std::vector<int64_t>& input_splits,
                                  const c10d::AllToAllOptions& opts) {
  ++seq_;
  if (!output_splits.empty() || !input_splits.empty()) {
    // Uneven splits of dim 0: in shared memory when they describe the tensors; what does not
    // (gloo raises c10d's error for it, before communicating) goes to gloo.
    const auto bytes = uneven_split_bytes(output, input, output_splits, input_splits, getSize());
    if (!bytes)
      return gloo(OpCode::kAllToAllUneven, {})
          .alltoall_base(output, input, output_splits, input_splits, opts);
    const at::Tensor in = input.contiguous();
    on_contiguous(output, false, [&](const at::Tensor& out) {
      group_->all_to_all_uneven(out, in, bytes->send, bytes->send_at, bytes->recv, bytes->recv_at);
    });
    return done({output}, OpType::ALLTOALL_BASE);
  }
  if (!movable(output) || !movable(input) || input.numel() % getSize() != 0 ||
      output.numel() != input.numel() || output.scalar_type() != input.scalar_type())
    return gloo(OpCode::kAllToAll, {})
        .alltoall_base(output, input, output_splits, input_splits, opts);
  const at::Tensor in = input.contiguous();
  on_contiguous(output, false, [&](const at::Tensor& out) { group_->all_to_all(out, in); });
  return done({output}, OpType::ALLTOALL_BASE);
}

WorkPtr ShmBackend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                             const c10d::AllToAllOptions& opts) {
  ++seq_;
  return gloo(OpCode::kAllToAll, {}).alltoall(outputs, inputs, opts);
}

WorkPtr ShmBackend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  if (tensors.size() != 1 || !movable(tensors)) return fallback().send(tensors, dst, tag);
  auto sent = group_->isend(tensors[0].contiguous(), dst, tag);
  if (sent->done) return done(tensors, OpType::SEND);
  ++fast_ops_;
  return c10::make_intrusive<SendWork>(c10::intrusive_ptr<c10d::Backend>::reclaim_copy(this),
                                       group_.get(), std::move(sent), tensors[0]);
}

WorkPtr ShmBackend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  if (tensors.size() != 1 || !movable(tensors)) return fallback().recv(tensors, src, tag);
  at::Tensor user = tensors[0];
  at::Tensor buffer = user.is_contiguous() ? user : at::empty(user.sizes(), user.options());
  auto posted = group_->post_recv(buffer, src, tag);
  ++fast_ops_;
  return c10::make_intrusive<RecvWork>(c10::intrusive_ptr<c10d::Backend>::reclaim_copy(this),
                                       group_.get(), std::move(posted), user, buffer);
}

WorkPtr ShmBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  if (tensors.size() != 1 || !movable(tensors)) return fallback().recvAnysource(tensors, tag);
  return recv(tensors, Group::kAnySource, tag);
}

WorkPtr ShmBackend::barrier(const c10d::BarrierOptions& opts) {
  ++seq_;
  group_->barrier();
  return done({}, OpType::BARRIER);
}

void ShmBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  ++seq_;
  // An unset timeout (negative) means the group's.
  group_->monitored_barrier(opts.timeout.count() >= 0 ? opts.timeout : timeout_, wait_all_ranks);
  ++fast_ops_;
}

}  // namespace tpcore::shm
