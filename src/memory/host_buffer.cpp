#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "core/fail.h"
#include "refit/memory.h"

namespace refit {

HostBuffer::HostBuffer(size_t bytes) : size_(bytes) {
  if (bytes == 0) return;
  // Anonymous mappings are page-aligned and zero-filled; huge pages cut TLB misses on the
  // multi-GiB copies that packing and loading do.
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    size_ = 0;
    fail(ErrorKind::kTransport, "cannot allocate a host transfer buffer of {} bytes: {}", bytes, std::strerror(errno));
  }
  madvise(p, bytes, MADV_HUGEPAGE);
  data_ = static_cast<std::byte*>(p);
}

HostBuffer::~HostBuffer() { release(); }

HostBuffer::HostBuffer(HostBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

HostBuffer& HostBuffer::operator=(HostBuffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void HostBuffer::release() noexcept {
  if (data_ != nullptr) munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

uint64_t total_host_memory_bytes() {
  long pages = sysconf(_SC_PHYS_PAGES);
  long page_size = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) fail(ErrorKind::kIo, "cannot read this host's total memory (sysconf)");
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
}

}  // namespace refit
