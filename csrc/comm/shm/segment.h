// A POSIX shared-memory segment mapped by every rank of a group on one host.
//
// The creator makes it under a random name; the others open that name; once every rank
// has mapped it, the creator unlinks the name, so that no crash, not even SIGKILL, can
// leave it behind in /dev/shm (the mapping lives on until the last rank unmaps it).
#pragma once

#include <cstddef>
#include <string>

namespace tpcore::shm {

class Segment {
 public:
  Segment() = default;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment();

  // Creates a zero-filled segment of `bytes` under a fresh name (see name()).
  static Segment create(size_t bytes);
  // Maps the segment `name` that another rank created, checking it has `bytes`.
  static Segment open(const std::string& name, size_t bytes);

  Segment(Segment&& other) noexcept;
  Segment& operator=(Segment&& other) noexcept;

  // Removes the name (idempotent); the mapping stays valid.
  void unlink();

  void* data() const { return data_; }
  size_t size() const { return bytes_; }
  const std::string& name() const { return name_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  std::string name_;
  bool linked_ = false;
};

}  // namespace tpcore::shm
