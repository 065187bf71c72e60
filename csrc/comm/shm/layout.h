// The shared segment of one group: who is where. Every rank computes the same offsets
// from (world, slot_bytes, cell_bytes, cells), so only the segment's name is exchanged.
//
//   Header | RankControl x world | data slots: world x 2 (double buffer) x slot_bytes |
//   result areas: world x slot_bytes | channels: world x world x (Channel + cells x Cell)
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "comm/shm/wait.h"

namespace tpcore::shm {

constexpr uint64_t kMagic = 0x74706373686d3031;  // "tpcshm01"

struct alignas(64) Header {
  uint64_t magic;
  uint32_t world;
  uint64_t slot_bytes;
  uint64_t cell_bytes;
  uint32_t cells;
  // 1 + the rank that gave up on the group (0: none), and why: peers stop at once.
  std::atomic<uint32_t> aborted;
  char reason[512];
};

// What a rank announces with each step, so mismatched calls are caught, not mis-summed.
struct OpHeader {
  uint32_t op;
  uint32_t dtype;
  uint64_t numel;
  int64_t extra;          // reduce kind, root rank, ... (through gloo: 1000 x reduce op + root)
  uint32_t algorithm;     // which of an operation's algorithms (all_reduce: 1 = two-step)
  uint32_t through_gloo;  // 1: the operation runs on the gloo fallback after this step
};

struct alignas(64) RankControl {
  WaitWord step;   // the last step this rank has published
  WaitWord inbox;  // bumped by every cell sent to this rank: a receiver sleeps on it
  OpHeader op[2];  // its header for the step of each parity
  int32_t pid;
};

// A one-way link src -> dst of `cells` cells: head counts cells written, tail cells consumed.
struct alignas(64) Channel {
  WaitWord head;
  WaitWord tail;
};

struct alignas(64) Cell {
  int64_t tag;
  uint64_t total;   // bytes of the whole message
  uint64_t offset;  // of this cell's bytes within it
  uint64_t bytes;   // in this cell
  int64_t dtype;    // the sender's at::ScalarType, or -1 for raw bytes
};

inline size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

class Layout {
 public:
  Layout(int world, size_t slot_bytes, size_t cell_bytes, int cells)
      : world_(world), slot_(slot_bytes), cell_(cell_bytes), cells_(cells) {
    control_ = round_up(sizeof(Header), 4096);
    data_ = round_up(control_ + sizeof(RankControl) * world, 4096);
    result_ = data_ + 2 * slot_ * world;
    channels_ = round_up(result_ + slot_ * world, 4096);
    channel_stride_ = round_up(sizeof(Channel) + cells_ * (sizeof(Cell) + cell_), 64);
    total_ = channels_ + channel_stride_ * world * world;
  }
  size_t total() const { return total_; }
  size_t slot_bytes() const { return slot_; }
  size_t cell_bytes() const { return cell_; }
  int cells() const { return cells_; }

  Header* header(void* base) const { return static_cast<Header*>(base); }
  RankControl* control(void* base, int r) const {
    return reinterpret_cast<RankControl*>(at(base, control_)) + r;
  }
  char* slot(void* base, int r, uint32_t step) const {
    return at(base, data_ + (size_t(r) * 2 + (step & 1)) * slot_);
  }
  char* result(void* base, int r) const { return at(base, result_ + size_t(r) * slot_); }
  Channel* channel(void* base, int src, int dst) const {
    return reinterpret_cast<Channel*>(at(base, channel_offset(src, dst)));
  }
  Cell* cell(void* base, int src, int dst, uint32_t i) const {
    return reinterpret_cast<Cell*>(at(
        base, channel_offset(src, dst) + sizeof(Channel) + (i % cells_) * (sizeof(Cell) + cell_)));
  }
  char* cell_data(Cell* c) const { return reinterpret_cast<char*>(c) + sizeof(Cell); }

 private:
  static char* at(void* base, size_t off) { return static_cast<char*>(base) + off; }
  size_t channel_offset(int src, int dst) const {
    return channels_ + (size_t(src) * world_ + dst) * channel_stride_;
  }
  int world_;
  size_t slot_, cell_;
  int cells_;
  size_t control_, data_, result_, channels_, channel_stride_, total_;
};

}  // namespace tpcore::shm
