// Host memory for transfer buffers, and the machine's memory capacity for bucket sizing.
// A HostBuffer is page-aligned, zero-filled, and owned: it is freed when destroyed.
#pragma once

#include <cstddef>
#include <cstdint>

namespace refit {

class HostBuffer {
 public:
  HostBuffer() = default;
  explicit HostBuffer(size_t bytes);  // throws Error(kTransport) when the allocation fails
  ~HostBuffer();
  HostBuffer(HostBuffer&& other) noexcept;
  HostBuffer& operator=(HostBuffer&& other) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void release() noexcept;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

// Total physical memory of this host in bytes (capacity, not what is free: the bucket size must
// not change from one refit to the next).
uint64_t total_host_memory_bytes();

}  // namespace refit
