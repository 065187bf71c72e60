#include "comm/shm/group.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <sstream>

namespace tpcore::shm {
namespace {

const char* op_name(uint32_t op) {
  switch (static_cast<OpCode>(op)) {
    case OpCode::kAllReduce:
      return "all_reduce";
    case OpCode::kAllGather:
      return "all_gather";
    case OpCode::kReduceScatter:
      return "reduce_scatter";
    case OpCode::kBroadcast:
      return "broadcast";
    case OpCode::kBarrier:
      return "barrier";
    case OpCode::kAllToAll:
      return "all_to_all";
    case OpCode::kReduce:
      return "reduce";
    case OpCode::kGather:
      return "gather";
    case OpCode::kScatter:
      return "scatter";
    case OpCode::kAllToAllUneven:
      return "all_to_all (uneven splits)";
  }
  return "an unknown operation";
}

bool after_or_at(uint32_t seen, uint32_t step) { return static_cast<int32_t>(seen - step) >= 0; }

OpHeader header(OpCode op, const at::Tensor& t, int64_t extra) {
  return OpHeader{static_cast<uint32_t>(op),
                  static_cast<uint32_t>(t.scalar_type()),
                  static_cast<uint64_t>(t.numel()),
                  extra,
                  0,
                  0};
}

bool same(const OpHeader& a, const OpHeader& b) {
  return a.op == b.op && a.dtype == b.dtype && a.numel == b.numel && a.extra == b.extra &&
         a.algorithm == b.algorithm && a.through_gloo == b.through_gloo;
}

}  // namespace

Group::Group(int rank, int world, const Config& config,
             const std::function<void(const std::string&)>& publish_name,
             const std::function<std::string()>& fetch_name, const std::function<void()>& mapped,
             const std::function<void()>& wait_all_mapped)
    : rank_(rank),
      world_(world),
      config_(config),
      layout_(world, round_up(config.slot_bytes, 64), round_up(config.cell_bytes, 64),
              config.cells) {
  TORCH_CHECK_VALUE(world >= 1 && rank >= 0 && rank < world, "tpcore shm: bad rank ", rank, " of ",
                    world);
  TORCH_CHECK_VALUE(config.slot_bytes >= 64 * static_cast<size_t>(world) &&
                        config.cell_bytes >= 64 && config.cells >= 2,
                    "tpcore shm: slot_bytes must be >= 64 x world, cell_bytes >= 64, cells >= 2");
  if (rank == 0) {
    segment_ = Segment::create(layout_.total());
    Header* h = layout_.header(base());
    h->world = world;
    h->slot_bytes = layout_.slot_bytes();
    h->cell_bytes = layout_.cell_bytes();
    h->cells = layout_.cells();
    h->magic = kMagic;
    publish_name(segment_.name());
  } else {
    try {
      segment_ = Segment::open(fetch_name(), layout_.total());
      const Header* h = layout_.header(base());
      TORCH_CHECK(h->magic == kMagic && h->world == static_cast<uint32_t>(world) &&
                      h->slot_bytes == layout_.slot_bytes() &&
                      h->cells == static_cast<uint32_t>(layout_.cells()),
                  "tpcore shm: segment ", segment_.name(),
                  " was made for another group layout (do all ranks use the same TPCORE_SHM_* "
                  "settings?)");
    } catch (...) {
      // Counted as done all the same: rank 0 unlinks the segment now rather than after its
      // timeout, so a kill in between leaves nothing in /dev/shm.
      mapped();
      throw;
    }
  }
  control(rank)->pid = static_cast<int32_t>(getpid());
  mapped();
  if (rank == 0) {
    wait_all_mapped();
    segment_.unlink();  // from now on nothing can be left behind in /dev/shm
  }
  policy_.spin_iters = world <= usable_cpus() ? 2000 : 0;
  for (int r = 0; r < world; ++r) send_mu_.push_back(std::make_unique<std::mutex>());
  sent_cells_.assign(world, 0);
  queued_.resize(world);
  incoming_.resize(world);
}

std::string Group::describe(const OpHeader& h) const {
  std::ostringstream out;
  out << op_name(h.op);
  const auto op = static_cast<OpCode>(h.op);
  if (op != OpCode::kBarrier && (h.numel > 0 || !h.through_gloo))
    out << " of " << h.numel << " " << c10::toString(static_cast<at::ScalarType>(h.dtype))
        << " elements";
  if (op == OpCode::kBroadcast || op == OpCode::kReduce || op == OpCode::kGather ||
      op == OpCode::kScatter)
    out << " with root " << (h.through_gloo ? h.extra % 1000 : h.extra);
  if (op == OpCode::kAllReduce || op == OpCode::kReduceScatter || op == OpCode::kReduce)
    out << " (reduce op " << (h.through_gloo ? h.extra / 1000 : h.extra) << ")";
  if (h.through_gloo) out << " through gloo";
  return out.str();
}

void Group::fail(const std::string& reason) {
  abort(reason);
  C10_THROW_ERROR(DistBackendError, reason);
}

void Group::abort(const std::string& reason) {
  if (broken_.empty()) broken_ = reason;
  Header* h = layout_.header(base());
  uint32_t none = 0;
  // The first rank to give up names the cause for everyone.
  if (h->aborted.load() == 0) {
    std::snprintf(h->reason, sizeof(h->reason), "%s", reason.c_str());
    h->aborted.compare_exchange_strong(none, static_cast<uint32_t>(rank_) + 1);
  }
}

void Group::check_usable() {
  if (!broken_.empty())
    C10_THROW_ERROR(DistBackendError,
                    "tpcore shm: this group is unusable since an earlier failure: " + broken_);
}

void Group::check_aborted(const std::string& waiting_for) {
  const Header* h = layout_.header(base());
  const uint32_t by = h->aborted.load(std::memory_order_acquire);
  if (by != 0 && by != static_cast<uint32_t>(rank_) + 1) {
    const std::string why = "tpcore shm: rank " + std::to_string(rank_) + ": " + waiting_for +
                            " stopped because rank " + std::to_string(by - 1) +
                            " gave up: " + std::string(h->reason);
    if (broken_.empty()) broken_ = why;
    C10_THROW_ERROR(DistBackendError, why);
  }
}

void Group::check_peer(int peer, Clock::duration elapsed, const std::string& waiting_for) {
  check_aborted(waiting_for);
  const int pid = control(peer)->pid;
  if (!process_alive(pid))
    fail("tpcore shm: rank " + std::to_string(rank_) + ": " + waiting_for + ": rank " +
         std::to_string(peer) + " (pid " + std::to_string(pid) +
         ") has exited or died without joining it");
  if (elapsed > config_.timeout) {
    const auto s =
        std::chrono::duration_cast<std::chrono::milliseconds>(config_.timeout).count() / 1000.0;
    // "Timed out", capitalised as torch's own backends say it (log filters look for it).
    fail("tpcore shm: rank " + std::to_string(rank_) + ": Timed out after " + std::to_string(s) +
         " s in " + waiting_for + ", waiting for rank " + std::to_string(peer) +
         " (it has not reached this call: is it stuck, stopped, or running a different "
         "collective?)");
  }
}

void Group::sync(uint32_t step, const OpHeader& h) {
  RankControl* me = control(rank_);
  me->op[step & 1] = h;
  me->step.publish(step);
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    wait_until(
        control(r)->step, [step](uint32_t v) { return after_or_at(v, step); }, policy_,
        [&](Clock::duration elapsed) { check_peer(r, elapsed, describe(h)); });
  }
  // A peer that gave up on this step (its timeout) had published it already: the data it
  // left is abandoned, and a rank arriving late must fail as the others did, not use it.
  check_aborted(describe(h));
  for (int r = 0; r < world_; ++r) {
    const OpHeader& other = control(r)->op[step & 1];
    // Every rank compares the same headers, so all of them raise, and at the same step:
    // the group stays usable.
    TORCH_CHECK_VALUE(same(other, h), "tpcore shm: mismatched collectives: rank ", rank_,
                      " called ", describe(h), " but rank ", r, " called ", describe(other));
  }
}

void Group::reduce_parallel(void* out, const std::vector<const void*>& srcs, int64_t n,
                            at::ScalarType dtype, ReduceKind kind, bool stream) {
  const int64_t es = static_cast<int64_t>(c10::elementSize(dtype));
  // Threads only for blocks large enough to pay for waking them.
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / es);
  at::parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
    std::vector<const void*> part(srcs.size());
    for (size_t i = 0; i < srcs.size(); ++i) part[i] = static_cast<const char*>(srcs[i]) + lo * es;
    reduce(static_cast<char*>(out) + lo * es, part.data(), static_cast<int>(part.size()), hi - lo,
           dtype, kind, stream);
    // Each thread fences its own streaming stores: before the collective returns, whoever
    // reads the output next must see every line, whichever thread wrote it.
    if (stream) store_fence();
  });
}

void Group::all_reduce_one_shot(char* data, int64_t n, at::ScalarType dtype, ReduceKind kind) {
  const int64_t es = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t per_step = static_cast<int64_t>(layout_.slot_bytes()) / es;
  const OpHeader h{static_cast<uint32_t>(OpCode::kAllReduce),
                   static_cast<uint32_t>(dtype),
                   static_cast<uint64_t>(n),
                   static_cast<int64_t>(kind),
                   0,
                   0};
  std::vector<const void*> srcs(world_);
  for (int64_t off = 0; off < n || off == 0; off += per_step) {
    const int64_t m = std::min(per_step, n - off);
    const uint32_t step = ++step_;
    std::memcpy(layout_.slot(base(), rank_, step), data + off * es, m * es);
    sync(step, h);
    for (int r = 0; r < world_; ++r) srcs[r] = layout_.slot(base(), r, step);
    reduce_parallel(data + off * es, srcs, m, dtype, kind);
    if (n == 0) break;
  }
}

// Each step: everyone writes a chunk; rank r reduces part r of it into its result area;
// after a second sync everyone copies every part. Each rank reads 2x the chunk instead of
// world x, which pays from three ranks on.
void Group::all_reduce_two_step(char* data, int64_t n, at::ScalarType dtype, ReduceKind kind) {
  const int64_t es = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t per_step = static_cast<int64_t>(layout_.slot_bytes()) / es;
  const OpHeader h{static_cast<uint32_t>(OpCode::kAllReduce),
                   static_cast<uint32_t>(dtype),
                   static_cast<uint64_t>(n),
                   static_cast<int64_t>(kind),
                   1,
                   0};
  std::vector<const void*> srcs(world_);
  for (int64_t off = 0; off < n; off += per_step) {
    const int64_t m = std::min(per_step, n - off);
    // Parts of whole 16-element blocks (64 bytes for fp32), the last ones shorter or
    // empty. The ceiling of m / world, so that the world parts cover all m elements.
    const int64_t part = ((m + world_ - 1) / world_ + 15) / 16 * 16;
    auto part_range = [&](int r) {
      const int64_t lo = std::min(m, r * part);
      return std::make_pair(lo, std::min(m, lo + part));
    };
    const uint32_t step = ++step_;
    // Peers read every part of this rank's chunk but its own, which it reads where it is.
    const auto [lo, hi] = part_range(rank_);
    char* slot = layout_.slot(base(), rank_, step);
    std::memcpy(slot, data + off * es, lo * es);
    std::memcpy(slot + hi * es, data + (off + hi) * es, (m - hi) * es);
    sync(step, h);
    for (int r = 0; r < world_; ++r)
      srcs[r] = r == rank_ ? data + (off + lo) * es : layout_.slot(base(), r, step) + lo * es;
    reduce_parallel(layout_.result(base(), rank_), srcs, hi - lo, dtype, kind);
    sync(++step_, h);
    for (int r = 0; r < world_; ++r) {
      const auto [rlo, rhi] = part_range(r);
      std::memcpy(data + (off + rlo) * es, layout_.result(base(), r), (rhi - rlo) * es);
    }
  }
}

void Group::all_reduce(const at::Tensor& t, ReduceKind kind) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  TORCH_CHECK_VALUE(reducible(t.scalar_type(), kind), "tpcore shm: cannot reduce ",
                    t.scalar_type());
  char* data = static_cast<char*>(t.data_ptr());
  const size_t bytes = t.numel() * t.element_size();
  if (world_ > 2 && bytes >= config_.two_step_bytes) {
    all_reduce_two_step(data, t.numel(), t.scalar_type(), kind);
  } else {
    all_reduce_one_shot(data, t.numel(), t.scalar_type(), kind);
  }
}

void Group::all_gather(const at::Tensor& out, const at::Tensor& in) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  const int64_t bytes = in.numel() * in.element_size();
  const int64_t per_step = static_cast<int64_t>(layout_.slot_bytes());
  const char* src = static_cast<const char*>(in.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const OpHeader h = header(OpCode::kAllGather, in, 0);
  for (int64_t off = 0; off < bytes || off == 0; off += per_step) {
    const int64_t m = std::min(per_step, bytes - off);
    const uint32_t step = ++step_;
    if (world_ > 1) std::memcpy(layout_.slot(base(), rank_, step), src + off, m);
    sync(step, h);
    for (int r = 0; r < world_; ++r) {
      const char* part = r == rank_ ? src + off : layout_.slot(base(), r, step);
      // `in` may be this rank's part of `out` (Megatron's parameter all-gather is).
      if (part != dst + r * bytes + off) std::memcpy(dst + r * bytes + off, part, m);
    }
    if (bytes == 0) break;
  }
}

void Group::reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceKind kind) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  TORCH_CHECK_VALUE(reducible(in.scalar_type(), kind), "tpcore shm: cannot reduce ",
                    in.scalar_type());
  const int64_t es = in.element_size();
  const int64_t n = out.numel();
  // Each step carries `m` elements of every other rank's chunk, (world - 1) x m in the slot,
  // in rank order; this rank's own chunk is read from `in` where it is.
  const int64_t per_step =
      static_cast<int64_t>(layout_.slot_bytes()) / es / std::max(1, world_ - 1);
  const char* src = static_cast<const char*>(in.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const OpHeader h = header(OpCode::kReduceScatter, in, static_cast<int64_t>(kind));
  // Where chunk d sits in a slot written by rank r (r's own chunk is not there).
  auto place = [](int d, int r) { return d < r ? d : d - 1; };
  const bool stream = streams((world_ + 1) * n * es);
  std::vector<const void*> srcs(world_);
  for (int64_t off = 0; off < n || off == 0; off += per_step) {
    const int64_t m = std::min(per_step, n - off);
    const uint32_t step = ++step_;
    char* slot = layout_.slot(base(), rank_, step);
    for (int d = 0; d < world_; ++d)
      if (d != rank_)
        std::memcpy(slot + place(d, rank_) * m * es, src + (d * n + off) * es, m * es);
    sync(step, h);
    for (int r = 0; r < world_; ++r)
      srcs[r] = r == rank_ ? src + (rank_ * n + off) * es
                           : layout_.slot(base(), r, step) + place(rank_, r) * m * es;
    reduce_parallel(dst + off * es, srcs, m, in.scalar_type(), kind, stream);
    if (n == 0) break;
  }
}

void Group::broadcast(const at::Tensor& t, int root) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  TORCH_CHECK_VALUE(root >= 0 && root < world_, "tpcore shm: broadcast root ", root,
                    " is outside the group of ", world_);
  const int64_t bytes = t.numel() * t.element_size();
  const int64_t per_step = static_cast<int64_t>(layout_.slot_bytes());
  char* data = static_cast<char*>(t.data_ptr());
  const OpHeader h = header(OpCode::kBroadcast, t, root);
  for (int64_t off = 0; off < bytes || off == 0; off += per_step) {
    const int64_t m = std::min(per_step, bytes - off);
    const uint32_t step = ++step_;
    if (rank_ == root) std::memcpy(layout_.slot(base(), rank_, step), data + off, m);
    sync(step, h);
    if (rank_ != root) std::memcpy(data + off, layout_.slot(base(), root, step), m);
    if (bytes == 0) break;
  }
}

void Group::all_to_all(const at::Tensor& out, const at::Tensor& in) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  const int64_t chunk = in.numel() * in.element_size() / world_;
  const int64_t per_step = static_cast<int64_t>(layout_.slot_bytes()) / world_;
  const char* src = static_cast<const char*>(in.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const OpHeader h = header(OpCode::kAllToAll, in, 0);
  for (int64_t off = 0; off < chunk || off == 0; off += per_step) {
    const int64_t m = std::min(per_step, chunk - off);
    const uint32_t step = ++step_;
    char* slot = layout_.slot(base(), rank_, step);
    for (int d = 0; d < world_; ++d) std::memcpy(slot + d * m, src + d * chunk + off, m);
    sync(step, h);
    for (int r = 0; r < world_; ++r)
      std::memcpy(dst + r * chunk + off, layout_.slot(base(), r, step) + rank_ * m, m);
    if (chunk == 0) break;
  }
}

void Group::all_to_all_uneven(const at::Tensor& out, const at::Tensor& in,
                              const std::vector<int64_t>& send, const std::vector<int64_t>& send_at,
                              const std::vector<int64_t>& recv,
                              const std::vector<int64_t>& recv_at) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  const size_t w = static_cast<size_t>(world_);
  TORCH_CHECK(send.size() == w && send_at.size() == w && recv.size() == w && recv_at.size() == w,
              "tpcore shm: all_to_all: split lists of ", w, " ranks expected");
  // The sizes differ by rank: the header names the op and dtype only.
  const OpHeader h{static_cast<uint32_t>(OpCode::kAllToAllUneven),
                   static_cast<uint32_t>(in.scalar_type()),
                   0,
                   0,
                   0,
                   0};
  // Step 1: every rank publishes what it sends and expects; every rank checks every pair and
  // finds the largest, which sets the number of steps.
  TORCH_CHECK(2 * w * sizeof(int64_t) <= layout_.slot_bytes(),
              "tpcore shm: all_to_all: the slot cannot hold the split sizes of ", w, " ranks");
  uint32_t step = ++step_;
  auto* mine = reinterpret_cast<int64_t*>(layout_.slot(base(), rank_, step));
  std::copy(send.begin(), send.end(), mine);
  std::copy(recv.begin(), recv.end(), mine + w);
  sync(step, h);
  int64_t largest = 0;
  for (int s = 0; s < world_; ++s) {
    const auto* theirs = reinterpret_cast<const int64_t*>(layout_.slot(base(), s, step));
    for (int d = 0; d < world_; ++d) {
      const int64_t sent = theirs[d];
      const int64_t expected =
          reinterpret_cast<const int64_t*>(layout_.slot(base(), d, step))[w + s];
      TORCH_CHECK_VALUE(sent == expected, "tpcore shm: all_to_all: rank ", s, " sends rank ", d,
                        " ", sent, " bytes, rank ", d, " expects ", expected,
                        " (input_split_sizes and output_split_sizes disagree)");
      largest = std::max(largest, sent);
    }
  }
  // Then each step carries up to `per_step` bytes of every pair, destination d's in part d
  // of the sender's slot.
  const int64_t per_step = static_cast<int64_t>(layout_.slot_bytes()) / world_;
  const char* src = static_cast<const char*>(in.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  auto part = [&](int64_t total, int64_t off) {
    return std::max<int64_t>(0, std::min(per_step, total - off));
  };
  for (int64_t off = 0; off < largest; off += per_step) {
    step = ++step_;
    char* slot = layout_.slot(base(), rank_, step);
    for (int d = 0; d < world_; ++d)
      if (const int64_t m = part(send[d], off))
        std::memcpy(slot + d * per_step, src + send_at[d] + off, m);
    sync(step, h);
    for (int r = 0; r < world_; ++r)
      if (const int64_t m = part(recv[r], off))
        std::memcpy(dst + recv_at[r] + off, layout_.slot(base(), r, step) + rank_ * per_step, m);
  }
}

void Group::agree_on(const OpHeader& h) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  sync(++step_, h);
}

void Group::barrier() {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  sync(++step_, OpHeader{static_cast<uint32_t>(OpCode::kBarrier), 0, 0, 0, 0, 0});
}

}  // namespace tpcore::shm
