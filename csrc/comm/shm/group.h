// Collectives and point-to-point messages among the ranks of one group on one host,
// through a shared segment (see layout.h). No torch.distributed types: the c10d backend
// (backend.h) wraps this. Buffers are contiguous host memory.
//
// Collectives run in steps. In step s every rank writes its part into its slot of parity
// s % 2, publishes s with a header describing its call, and waits until every rank has
// published s; then it reads the slots of step s. A rank overwrites that slot only in step
// s + 2, after every rank has published s + 1, i.e. finished reading step s: double
// buffering instead of a closing barrier. Every rank reduces the same slots in rank order,
// so results are bitwise identical on every rank.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/shm/layout.h"
#include "comm/shm/reduce_loops.h"
#include "comm/shm/segment.h"
#include "comm/shm/stream_store.h"
#include "comm/shm/wait.h"

namespace tpcore::shm {

enum class OpCode : uint32_t {
  kAllReduce = 1,
  kAllGather,
  kReduceScatter,
  kBroadcast,
  kBarrier,
  kAllToAll,
  kReduce,  // these three only through gloo
  kGather,
  kScatter,
  kAllToAllUneven
};

struct Config {
  // Per rank and parity; larger messages go in chunks. 256 KiB was best here for 1-16 MiB
  // all-reduces (a step's slots stay in cache; benchmarks/RESULTS.md).
  size_t slot_bytes = 256 << 10;
  size_t cell_bytes = 256 << 10;  // per point-to-point cell
  int cells = 4;                  // cells per one-way link
  // At or above this many bytes, groups of more than two ranks all-reduce by
  // reduce-scatter + all-gather (each rank reduces 1/world) instead of one shot; it pays
  // from 32-64 KiB at 3 and 4 ranks here.
  size_t two_step_bytes = 32 << 10;
  // Reduce-scatters that move at least this many bytes (input + output) write their output
  // with streaming stores (float32 sums and averages over two ranks, with AVX2): it cannot
  // stay in the cache anyway, and they save a read-for-ownership of every line. 5-15% faster
  // at 16-64 MiB in both of the 2-core VM's states. All-gathers do not stream (faster in one
  // state, slower in the other), nor do slots, which a peer reads next (up to 50% slower in
  // one state). benchmarks/RESULTS.md has the figures. Default: the last-level cache's size;
  // 0 = never.
  size_t stream_bytes = last_level_cache_bytes();
  std::chrono::milliseconds timeout{600000};
};

class Group {
 public:
  // Rank 0 creates the segment and passes its name through `publish_name`; the others
  // receive it from `fetch_name`. `all_mapped` returns once every rank has mapped it, after
  // which rank 0 unlinks the name.
  Group(int rank, int world, const Config& config,
        const std::function<void(const std::string&)>& publish_name,
        const std::function<std::string()>& fetch_name, const std::function<void()>& mapped,
        const std::function<void()>& wait_all_mapped);
  ~Group();

  int rank() const { return rank_; }
  int world() const { return world_; }
  const std::string& segment_name() const { return segment_.name(); }

  // In place over the group: t = t_0 (op) t_1 ... in rank order.
  void all_reduce(const at::Tensor& t, ReduceKind kind);
  // out [world * n] = every rank's in [n], in rank order.
  void all_gather(const at::Tensor& out, const at::Tensor& in);
  // out [n] = reduction over ranks of chunk `rank` of in [world * n].
  void reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceKind kind);
  // t = root's t.
  void broadcast(const at::Tensor& t, int root);
  // out chunk r [n] = rank r's in chunk `rank` [n] (in, out: [world * n]).
  void all_to_all(const at::Tensor& out, const at::Tensor& in);
  // The same with chunks of any size: `send[d]` bytes at byte `send_at[d]` of `in` go to rank
  // d, `recv[r]` bytes from rank r land at byte `recv_at[r]` of `out`. Every rank checks that
  // every pair's sizes agree (rank s sends rank d what d expects), so all raise alike if not.
  void all_to_all_uneven(const at::Tensor& out, const at::Tensor& in,
                         const std::vector<int64_t>& send, const std::vector<int64_t>& send_at,
                         const std::vector<int64_t>& recv, const std::vector<int64_t>& recv_at);
  void barrier();
  // One step that only compares `h` (through_gloo set) with every rank's: what the c10d
  // backend runs before an operation it hands to gloo, so that ranks calling different
  // operations, whichever transport each takes, all get the mismatch error.
  void agree_on(const OpHeader& h);

  // Point to point (p2p.cpp). isend writes what fits of the message into the link and
  // returns; the rest is queued and written as the peer drains the link, whenever this rank
  // waits on anything point-to-point (wait_send, wait_recv), so a rank computing between
  // posting and waiting does not hold its peer's send up. Messages to one peer keep their
  // order. post_recv registers a receive; wait_recv completes it. A receive from
  // kAnySource takes the first message with its tag from whichever rank, and then names
  // that rank in `src`. Receives match arriving messages in the order they were posted.
  // Waiting drains incoming links and pushes queued sends, so ranks that send to each
  // other at once cannot deadlock.
  static constexpr int kAnySource = -1;
  struct Recv {
    int src;
    int64_t tag;
    char* data;
    uint64_t bytes;
    uint64_t posted;     // order of posting, among this group's receives
    int64_t dtype = -1;  // the at::ScalarType expected, or -1 for raw bytes
    bool done = false;
    std::string error;  // set when the message that arrived does not fit
  };
  struct Send {
    at::Tensor keep;  // holds the bytes until they are all in the link
    const char* data;
    uint64_t total;
    int dst;
    int64_t tag, dtype;
    uint64_t off = 0;      // bytes written so far
    bool started = false;  // a first cell is written (a message of 0 bytes is one cell)
    bool done = false;
  };
  std::shared_ptr<Send> isend(const at::Tensor& t, int dst, int64_t tag);
  void wait_send(const std::shared_ptr<Send>& s);
  // Writes what fits of the queued sends; whether `s` (if given) is done.
  bool push_sends(const Send* s = nullptr);
  std::shared_ptr<Recv> post_recv(const at::Tensor& t, int src, int64_t tag);
  void wait_recv(const std::shared_ptr<Recv>& r);

  // torch's monitored_barrier (monitored_barrier.cpp): rank 0 waits at most `timeout` for
  // every other rank and, if one is missing, fails naming it (every missing rank with
  // `wait_all`); the group is then unusable, so every rank raises with rank 0's reason.
  void monitored_barrier(std::chrono::milliseconds timeout, bool wait_all);

  // Gives up on the group: peers stop waiting and raise `reason` too.
  void abort(const std::string& reason);

 private:
  RankControl* control(int r) const { return layout_.control(base(), r); }
  void* base() const { return segment_.data(); }
  // Publishes `step` with `header`, waits for every rank to publish it, checks headers.
  void sync(uint32_t step, const OpHeader& header);
  // Throws if the group was aborted, `peer` died or `elapsed` passed the timeout.
  void check_peer(int peer, Clock::duration elapsed, const std::string& waiting_for);
  void check_usable();
  // Throws if a peer aborted the group.
  void check_aborted(const std::string& waiting_for);
  [[noreturn]] void fail(const std::string& reason);
  std::string describe(const OpHeader& h) const;
  void all_reduce_one_shot(char* data, int64_t n, at::ScalarType dtype, ReduceKind kind);
  void all_reduce_two_step(char* data, int64_t n, at::ScalarType dtype, ReduceKind kind);
  void reduce_parallel(void* out, const std::vector<const void*>& srcs, int64_t n,
                       at::ScalarType dtype, ReduceKind kind, bool stream = false);
  bool streams(int64_t moved_bytes) const {
    return config_.stream_bytes > 0 && static_cast<size_t>(moved_bytes) >= config_.stream_bytes;
  }

  // p2p.cpp. A message being received or kept: where its bytes go, how many arrived.
  struct Message {
    int64_t tag;
    uint64_t total;
    uint64_t arrived;  // order of arrival, among this group's messages from every rank
    int64_t dtype;     // as the sender gave it (Cell::dtype)
    uint64_t received = 0;
    std::shared_ptr<Recv> recv;  // null while nobody has asked for it
    bool keep = false;           // arriving into `kept`, not into recv's buffer
    std::vector<char> kept;      // its bytes when it arrived before its receive
  };
  struct Incoming {
    uint32_t consumed = 0;                           // cells read from the link
    std::shared_ptr<Message> current;                // the message whose cells are arriving
    std::deque<std::shared_ptr<Recv>> posted;        // receives not matched yet, in post order
    std::deque<std::shared_ptr<Message>> unclaimed;  // messages nobody asked for yet
  };
  static void finish_recv(Recv& r, const Message& m);
  // A blocking send of raw bytes (after the queued sends to `dst`).
  void send(const char* data, uint64_t bytes, int dst, int64_t tag, int64_t dtype = -1);
  // Writes cells of `s` while the link to s.dst has room (caller holds send_mu_[s.dst]);
  // true once all are written.
  bool write_cells(Send& s);
  // Waits until the link to `dst` has room or the peer drained some (caller holds
  // send_mu_[dst]); `start` is when the wait began, for timeouts and errors.
  void wait_for_room(int dst, Clock::time_point start, Clock::time_point& next_check,
                     const std::string& what);
  std::shared_ptr<Recv> post_recv(char* data, uint64_t bytes, int src, int64_t tag,
                                  int64_t dtype = -1);
  // Waits for `r`; false once `deadline` has passed (a dead peer or an aborted group raise).
  // `what` names the wait in errors (default: the message awaited).
  bool wait_recv_until(const std::shared_ptr<Recv>& r, Clock::time_point deadline,
                       std::string what = {});
  // Takes a posted receive that will not be waited for off the queues.
  void cancel_recv(const std::shared_ptr<Recv>& r);
  void check_any_peer(Clock::duration elapsed, const std::string& waiting_for);
  void drain(int src, const Recv* until);
  void progress_all();

  int rank_, world_;
  Config config_;
  Layout layout_;
  Segment segment_;
  WaitPolicy policy_;
  uint32_t step_ = 0;
  std::string broken_;
  std::mutex mu_;      // one collective at a time
  std::mutex p2p_mu_;  // incoming links' state
  std::vector<std::unique_ptr<std::mutex>> send_mu_;
  std::vector<uint32_t> sent_cells_;
  std::vector<std::deque<std::shared_ptr<Send>>> queued_;  // by peer, under send_mu_[peer]
  std::vector<std::unique_ptr<Incoming>> incoming_;
  std::deque<std::shared_ptr<Recv>> any_posted_;  // receives from any source, not matched yet
  uint64_t posts_ = 0, arrivals_ = 0;
  uint32_t monitored_barriers_ = 0;
};

}  // namespace tpcore::shm
