// Point-to-point messages through one-way links of `cells` cells each (layout.h).
//
// A message is one or more consecutive cells; the receiver matches messages to posted
// receives by tag, in arrival order (receives with the same tag from the same rank match
// in the order posted). A message that arrives before its receive is posted is kept in a
// buffer of its own. A send writes what fits and queues the rest, written whenever the
// rank waits on anything point-to-point; a rank waiting drains its own incoming links and
// pushes its queued sends, so ranks that send to each other at once always make progress.
// A receiver that frees room rings the sender's inbox, which a waiting sender sleeps on.
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

#include "comm/shm/group.h"

namespace tpcore::shm {

Group::~Group() = default;

namespace {

std::string dtype_name(int64_t dtype) {
  return dtype < 0 ? std::string("bytes") : c10::toString(static_cast<at::ScalarType>(dtype));
}

// Why a message of `total` bytes of `dtype` from `src` does not fit receive `r` ("" if it
// fits). Raw bytes (-1) on either side fit any dtype.
std::string misfit(int me, int src, const Group::Recv& r, uint64_t total, int64_t dtype) {
  if (r.bytes == total && (r.dtype < 0 || dtype < 0 || r.dtype == dtype)) return "";
  return "tpcore shm: rank " + std::to_string(me) + " expected a message of " +
         std::to_string(r.bytes) + " bytes of " + dtype_name(r.dtype) + " with tag " +
         std::to_string(r.tag) + " from rank " + std::to_string(src) + ", but rank " +
         std::to_string(src) + " sent " + std::to_string(total) + " bytes of " + dtype_name(dtype) +
         " with that tag";
}

}  // namespace

void Group::finish_recv(Recv& r, const Message& m) {
  if (r.error.empty() && m.keep && m.total > 0) std::memcpy(r.data, m.kept.data(), m.total);
  r.done = true;
}

// Reads the cells that have arrived from `src` (caller holds p2p_mu_). With `until`, stops
// as soon as that receive is complete, leaving later cells in the link for their own
// receive to read straight into its buffer.
void Group::drain(int src, const Recv* until) {
  bool freed = false;  // room made in the link: wake the sender if it waits for some
  struct RingSender {
    Group* g;
    int src;
    bool& freed;
    ~RingSender() {
      if (freed) g->control(src)->inbox.bump();
    }
  } ring{this, src, freed};
  if (!incoming_[src]) incoming_[src] = std::make_unique<Incoming>();
  Incoming& in = *incoming_[src];
  Channel* link = layout_.channel(base(), src, rank_);
  while (link->head.value.load(std::memory_order_acquire) != in.consumed) {
    if (until != nullptr && until->done) return;
    Cell* cell = layout_.cell(base(), src, rank_, in.consumed);
    if (cell->offset == 0) {
      auto m = std::make_shared<Message>();
      m->tag = cell->tag;
      m->total = cell->total;
      m->arrived = arrivals_++;
      m->dtype = cell->dtype;
      // The earliest posted receive that takes it: one from this rank, or from any rank.
      auto tagged = [&](const std::shared_ptr<Recv>& r) { return r->tag == cell->tag; };
      auto mine = std::find_if(in.posted.begin(), in.posted.end(), tagged);
      auto any = std::find_if(any_posted_.begin(), any_posted_.end(), tagged);
      if (any != any_posted_.end() &&
          (mine == in.posted.end() || (*any)->posted < (*mine)->posted)) {
        m->recv = *any;
        m->recv->src = src;
        any_posted_.erase(any);
      } else if (mine != in.posted.end()) {
        m->recv = *mine;
        in.posted.erase(mine);
      }
      if (m->recv) {
        m->recv->error = misfit(rank_, src, *m->recv, m->total, m->dtype);
        if (!m->recv->error.empty()) {
          m->keep = true;  // read and drop it, so the link stays in step
          m->kept.resize(m->total);
        }
      } else {
        m->keep = true;
        m->kept.resize(m->total);
        in.unclaimed.push_back(m);
      }
      in.current = m;
    }
    TORCH_CHECK(in.current && cell->offset == in.current->received && cell->tag == in.current->tag,
                "tpcore shm: corrupt point-to-point link from rank ", src, " to rank ", rank_);
    Message& m = *in.current;
    if (cell->bytes > 0) {
      char* dst = m.keep ? m.kept.data() : m.recv->data;
      std::memcpy(dst + cell->offset, layout_.cell_data(cell), cell->bytes);
    }
    m.received += cell->bytes;
    link->tail.publish(++in.consumed);
    freed = true;
    if (m.received == m.total) {
      if (m.recv) {
        finish_recv(*m.recv, m);
        // Claimed while arriving: it no longer needs a place in the unclaimed queue.
        auto it = std::find(in.unclaimed.begin(), in.unclaimed.end(), in.current);
        if (it != in.unclaimed.end()) in.unclaimed.erase(it);
      }
      in.current.reset();
    }
  }
}

void Group::progress_all() {
  std::lock_guard<std::mutex> lock(p2p_mu_);
  for (int r = 0; r < world_; ++r)
    if (r != rank_) drain(r, nullptr);
}

std::shared_ptr<Group::Send> Group::isend(const at::Tensor& t, int dst, int64_t tag) {
  check_usable();
  TORCH_CHECK_VALUE(dst >= 0 && dst < world_ && dst != rank_, "tpcore shm: send: peer ", dst,
                    " is not another rank of this group of ", world_);
  auto s = std::make_shared<Send>();
  s->keep = t;
  s->data = static_cast<const char*>(t.data_ptr());
  s->total = t.numel() * t.element_size();
  s->dst = dst;
  s->tag = tag;
  s->dtype = static_cast<int64_t>(t.scalar_type());
  std::lock_guard<std::mutex> lock(*send_mu_[dst]);
  if (queued_[dst].empty() && write_cells(*s))
    s->done = true;
  else
    queued_[dst].push_back(s);
  return s;
}

bool Group::write_cells(Send& s) {
  Channel* link = layout_.channel(base(), rank_, s.dst);
  const uint32_t cells = static_cast<uint32_t>(layout_.cells());
  uint32_t& head = sent_cells_[s.dst];
  while (!s.started || s.off < s.total) {
    if (head - link->tail.value.load(std::memory_order_acquire) >= cells) return false;
    Cell* cell = layout_.cell(base(), rank_, s.dst, head);
    const uint64_t bytes = std::min<uint64_t>(layout_.cell_bytes(), s.total - s.off);
    cell->tag = s.tag;
    cell->total = s.total;
    cell->dtype = s.dtype;
    cell->offset = s.off;
    cell->bytes = bytes;
    std::memcpy(layout_.cell_data(cell), s.data + s.off, bytes);
    link->head.publish(++head);
    control(s.dst)->inbox.bump();
    s.off += bytes;
    s.started = true;
  }
  return true;
}

bool Group::push_sends(const Send* s) {
  for (int dst = 0; dst < world_; ++dst) {
    if (dst == rank_) continue;
    // Another thread holding it is sending to `dst` itself: it writes the queue first.
    std::unique_lock<std::mutex> lock(*send_mu_[dst], std::try_to_lock);
    if (!lock.owns_lock()) continue;
    auto& queue = queued_[dst];
    while (!queue.empty() && write_cells(*queue.front())) {
      queue.front()->done = true;
      queue.front()->keep = at::Tensor();
      queue.pop_front();
    }
  }
  return s != nullptr && s->done;
}

void Group::wait_for_room(int dst, Clock::time_point start, Clock::time_point& next_check,
                          const std::string& what) {
  Channel* link = layout_.channel(base(), rank_, dst);
  const uint32_t cells = static_cast<uint32_t>(layout_.cells());
  const uint32_t head = sent_cells_[dst];
  progress_all();  // keep our own incoming links moving while the peer drains this one
  const uint32_t seen = link->tail.value.load(std::memory_order_seq_cst);
  if (head - seen < cells) return;
  link->tail.sleepers.fetch_add(1, std::memory_order_seq_cst);
  if (head - link->tail.value.load(std::memory_order_seq_cst) >= cells)
    futex_wait(&link->tail.value, seen, std::chrono::microseconds(200));
  link->tail.sleepers.fetch_sub(1, std::memory_order_seq_cst);
  const auto now = Clock::now();
  if (now >= next_check) {
    check_peer(dst, now - start, what);
    next_check = now + policy_.check_every;
  }
}

void Group::send(const char* data, uint64_t total, int dst, int64_t tag, int64_t dtype) {
  std::lock_guard<std::mutex> lock(*send_mu_[dst]);
  const std::string what = "sending " + std::to_string(total) + " bytes with tag " +
                           std::to_string(tag) + " to rank " + std::to_string(dst);
  const auto start = Clock::now();
  auto next_check = start + policy_.check_every;
  auto& queue = queued_[dst];
  while (!queue.empty()) {  // what was posted before goes first
    while (!write_cells(*queue.front())) wait_for_room(dst, start, next_check, what);
    queue.front()->done = true;
    queue.front()->keep = at::Tensor();
    queue.pop_front();
  }
  Send s;
  s.data = data;
  s.total = total;
  s.dst = dst;
  s.tag = tag;
  s.dtype = dtype;
  while (!write_cells(s)) wait_for_room(dst, start, next_check, what);
}

void Group::wait_send(const std::shared_ptr<Send>& s) {
  if (s->done || push_sends(s.get())) return;
  const std::string what = "sending " + std::to_string(s->total) + " bytes with tag " +
                           std::to_string(s->tag) + " to rank " + std::to_string(s->dst);
  WaitWord& inbox = control(rank_)->inbox;
  const auto start = Clock::now();
  auto next_check = start + policy_.check_every;
  while (true) {
    // Rung by the peer when it drains our link (and by anyone sending to us).
    const uint32_t seen = inbox.value.load(std::memory_order_seq_cst);
    progress_all();  // our incoming links too: the peer may be waiting on our room
    if (push_sends(s.get())) return;
    inbox.sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (inbox.value.load(std::memory_order_seq_cst) == seen)
      futex_wait(&inbox.value, seen, std::chrono::microseconds(200));
    inbox.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    const auto now = Clock::now();
    if (now >= next_check) {
      check_peer(s->dst, now - start, what);
      next_check = now + policy_.check_every;
    }
  }
}

std::shared_ptr<Group::Recv> Group::post_recv(const at::Tensor& t, int src, int64_t tag) {
  check_usable();
  TORCH_CHECK_VALUE(src == kAnySource || (src >= 0 && src < world_ && src != rank_),
                    "tpcore shm: recv: peer ", src, " is not another rank of this group of ",
                    world_);
  return post_recv(static_cast<char*>(t.data_ptr()), t.numel() * t.element_size(), src, tag,
                   static_cast<int64_t>(t.scalar_type()));
}

std::shared_ptr<Group::Recv> Group::post_recv(char* data, uint64_t bytes, int src, int64_t tag,
                                              int64_t dtype) {
  auto r = std::make_shared<Recv>();
  r->src = src;
  r->tag = tag;
  r->data = data;
  r->bytes = bytes;
  r->dtype = dtype;
  std::lock_guard<std::mutex> lock(p2p_mu_);
  r->posted = posts_++;
  // A message that arrived before this receive: the earliest with its tag from `src`, or
  // from any rank.
  std::shared_ptr<Message> m;
  int from = -1;
  for (int peer = 0; peer < world_; ++peer) {
    if (peer == rank_ || (src != kAnySource && peer != src)) continue;
    if (!incoming_[peer]) incoming_[peer] = std::make_unique<Incoming>();
    for (const auto& kept : incoming_[peer]->unclaimed)
      if (kept->tag == tag && !kept->recv) {
        if (!m || kept->arrived < m->arrived) m = kept, from = peer;
        break;
      }
  }
  if (!m) {
    if (src == kAnySource)
      any_posted_.push_back(r);
    else
      incoming_[src]->posted.push_back(r);
    return r;
  }
  r->src = from;
  m->recv = r;
  r->error = misfit(rank_, from, *r, m->total, m->dtype);
  if (m->received == m->total) {
    finish_recv(*r, *m);
    auto& unclaimed = incoming_[from]->unclaimed;
    unclaimed.erase(std::find(unclaimed.begin(), unclaimed.end(), m));
  }
  return r;
}

void Group::cancel_recv(const std::shared_ptr<Recv>& r) {
  std::lock_guard<std::mutex> lock(p2p_mu_);
  auto drop = [&](std::deque<std::shared_ptr<Recv>>& q) {
    auto it = std::find(q.begin(), q.end(), r);
    if (it != q.end()) q.erase(it);
  };
  drop(any_posted_);
  for (auto& in : incoming_)
    if (in) drop(in->posted);
}

void Group::check_any_peer(Clock::duration elapsed, const std::string& waiting_for) {
  // Any live peer may still send: a peer's death alone is not a reason to stop, unless
  // every peer is dead. The abort and the timeout are checked as for one peer.
  bool any_alive = world_ == 1;
  for (int peer = 0; peer < world_; ++peer)
    if (peer != rank_ && process_alive(control(peer)->pid)) any_alive = true;
  for (int peer = 0; peer < world_; ++peer) {
    if (peer == rank_) continue;
    if (any_alive && !process_alive(control(peer)->pid)) continue;
    check_peer(peer, elapsed, waiting_for);
    break;
  }
}

bool Group::wait_recv_until(const std::shared_ptr<Recv>& r, Clock::time_point deadline,
                            std::string what) {
  const bool any = r->src == kAnySource;
  if (what.empty())
    what = "receiving " + std::to_string(r->bytes) + " bytes with tag " + std::to_string(r->tag) +
           " from " + (any ? std::string("any rank") : "rank " + std::to_string(r->src));
  // Drains the other incoming links too: a peer blocked sending to this rank (its link
  // full) may be what the awaited sender waits for, in a cycle of ranks (a ring of large
  // messages deadlocked without this). Messages with a posted receive go straight into it.
  auto poll = [&](uint32_t) {
    push_sends();  // a peer may wait for our queued send before it sends what we await
    std::lock_guard<std::mutex> lock(p2p_mu_);
    if (!any) drain(r->src, r.get());
    for (int other = 0; other < world_ && !r->done; ++other)
      if (other != rank_ && (any || other != r->src)) drain(other, nullptr);
    return r->done;
  };
  struct PastDeadline {};
  if (!poll(0)) {
    check_usable();
    // Wakes on this rank's inbox: each new cell from any rank re-runs the poll.
    try {
      wait_until(control(rank_)->inbox, poll, policy_, [&](Clock::duration elapsed) {
        if (Clock::now() > deadline) throw PastDeadline{};
        // The peer's death, an abort, or the group's own timeout.
        if (any)
          check_any_peer(elapsed, what);
        else
          check_peer(r->src, elapsed, what);
      });
    } catch (const PastDeadline&) {
      return false;
    }
  }
  TORCH_CHECK_VALUE(r->error.empty(), r->error);
  return true;
}

void Group::wait_recv(const std::shared_ptr<Recv>& r) {
  wait_recv_until(r, Clock::time_point::max());
}

}  // namespace tpcore::shm
