#include "comm/shm/segment.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <utility>

namespace tpcore::shm {
namespace {

std::string fresh_name() {
  std::random_device rd;
  const uint64_t r = (uint64_t(rd()) << 32) ^ rd();
  char buf[64];
  std::snprintf(buf, sizeof(buf), "/tpcore-%d-%016llx", static_cast<int>(getpid()),
                static_cast<unsigned long long>(r));
  return buf;
}

void* map(int fd, size_t bytes, const std::string& name) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  TORCH_CHECK(p != MAP_FAILED, "tpcore shm: cannot map shared memory ", name, " (", bytes,
              " bytes): ", std::strerror(err));
  return p;
}

}  // namespace

Segment::~Segment() {
  unlink();
  if (data_) munmap(data_, bytes_);
}

Segment::Segment(Segment&& o) noexcept { *this = std::move(o); }

Segment& Segment::operator=(Segment&& o) noexcept {
  if (this != &o) {
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    std::swap(name_, o.name_);
    std::swap(linked_, o.linked_);
  }
  return *this;
}

Segment Segment::create(size_t bytes) {
  Segment s;
  s.name_ = fresh_name();
  const int fd = shm_open(s.name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, "tpcore shm: cannot create shared memory ", s.name_, ": ",
              std::strerror(errno), " (is /dev/shm mounted and writable?)");
  s.linked_ = true;
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    close(fd);
    s.unlink();
    TORCH_CHECK(false, "tpcore shm: cannot size shared memory ", s.name_, " to ", bytes,
                " bytes: ", std::strerror(err), " (is /dev/shm large enough?)");
  }
  s.data_ = map(fd, bytes, s.name_);
  s.bytes_ = bytes;
  return s;
}

Segment Segment::open(const std::string& name, size_t bytes) {
  Segment s;
  s.name_ = name;
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, "tpcore shm: cannot open shared memory ", name, ": ", std::strerror(errno),
              " (do all ranks of the group share /dev/shm? set TPCORE_CPU_BACKEND=gloo if not)");
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    close(fd);
    TORCH_CHECK(false, "tpcore shm: shared memory ", name, " has ", st.st_size, " bytes, expected ",
                bytes, ": it was made for another group layout (do all ranks use the same",
                " TPCORE_SHM_* settings?)");
  }
  s.data_ = map(fd, bytes, name);
  s.bytes_ = bytes;
  return s;
}

void Segment::unlink() {
  if (linked_) {
    shm_unlink(name_.c_str());
    linked_ = false;
  }
}

}  // namespace tpcore::shm
