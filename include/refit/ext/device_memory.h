// Extension tier (refit/ext/: for backends, benches and bindings built on refit, not for its
// users' programs). The memory layer's GPU plumbing: one cudaMalloc allocation (DeviceBuffer),
// page-locking host memory someone else owns (HostPin), and copies in issue order with a bounded
// synchronize (CopyStream). Every one works, as a no-op or memcpy, where CUDA is not usable.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>

#include "refit/deadline.h"
#include "refit/device.h"

namespace refit {

// One cudaMalloc allocation on one GPU, zero-filled, freed by the destructor (move-only).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // Throws as check_device() for a device it cannot use, Error(kInvalidArgument) for cpu, and
  // Error(kTransport) when cudaMalloc fails ("cannot allocate 1.0 TiB on cuda:0 (80.0 GiB free of
  // 80.0 GiB): cudaMalloc: out of memory"). Zero bytes allocate nothing (data() is null).
  DeviceBuffer(const Device& device, size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  int device_index() const { return device_; }

 private:
  void release() noexcept;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  int device_ = -1;
};

// Page-locks host memory that someone else owns (a HostBuffer, a transport's allocation) with
// cudaHostRegister(cudaHostRegisterPortable), so that copies between it and any GPU run at PCIe
// speed and asynchronously. Unregisters in the destructor; the memory must outlive the pin.
//   pin_host_memory(base, bytes): returns false (and pins nothing) when CUDA is not usable here
//     (this build has no CUDA, or no GPU/driver: `reason` says which); true once pinned; throws
//     Error(kTransport) when CUDA is usable but cudaHostRegister fails.
//   unpin_host_memory(base): undoes it; throws Error(kTransport) on failure.
bool pin_host_memory(void* base, size_t bytes, std::string* reason = nullptr);
void unpin_host_memory(void* base);

class HostPin {
 public:
  HostPin() = default;
  // pin_host_memory() with RAII; pinned() says whether it did.
  static HostPin pin(void* base, size_t bytes);
  ~HostPin();
  HostPin(HostPin&& other) noexcept;
  HostPin& operator=(HostPin&& other) noexcept;
  HostPin(const HostPin&) = delete;
  HostPin& operator=(const HostPin&) = delete;

  bool pinned() const { return base_ != nullptr; }
  // Why nothing was pinned (empty when pinned()).
  const std::string& reason() const { return reason_; }

 private:
  void release() noexcept;
  void* base_ = nullptr;
  std::string reason_;
};

// Copies in issue order, finished by synchronize(). What the engine uses instead of memcpy when
// packing tensors into transfer buffers and loading them out:
//   - host to host: memcpy on the calling thread, at once. When it touches memory that an
//     unfinished GPU copy of this stream reads or writes, the stream is synchronized first, so
//     issue order is kept;
//   - any copy with a GPU side: cudaMemcpyAsync(cudaMemcpyDefault) on one dedicated non-blocking
//     stream, created at the first such copy on the stream's device. Pinned host memory makes
//     these asynchronous; pageable host memory still works (the driver stages it).
// Source bytes must stay unchanged and destination bytes unread until synchronize() returns.
// Not thread-safe: one stream per thread.
class CopyStream {
 public:
  // `device`: where the CUDA stream lives when a copy needs one: cuda:N, or the calling thread's
  // current device for "cuda" and "cpu". Creating a CopyStream never touches CUDA.
  explicit CopyStream(Device device = {});
  // Waits (bounded) for copies still in flight, then destroys the stream.
  ~CopyStream();
  CopyStream(const CopyStream&) = delete;
  CopyStream& operator=(const CopyStream&) = delete;

  // Enqueues a copy of `bytes` bytes. `dst_kind`/`src_kind` say where each side lives (a
  // TensorView's `memory`, or kCuda for a device transfer buffer). Between GPU memory, copies wait
  // and go out together, as copy_2d's do (no launch per small tensor). A GPU side throws
  // Error(kUnsupported) when CUDA is not usable here, naming why; a failed cudaMemcpyAsync
  // throws Error(kTransport) naming the call.
  void copy(void* dst, const void* src, size_t bytes, MemoryKind dst_kind, MemoryKind src_kind);

  // Copies `rows` rows of `row_bytes` bytes each: row r from src + r * src_pitch to
  // dst + r * dst_pitch. Between GPU memory, copies wait and go out together as one kernel per
  // ~100 (at synchronize(), before any other copy, or when that many wait): a source packing a
  // bucket of strided slices launches once instead of once per slice; with a host side,
  // cudaMemcpy2DAsync. A strided slice such as narrow(dim, start, len) of a row-major tensor is
  // one such copy: rows = the product of the dims before `dim`, row_bytes = len * (bytes of one
  // index of `dim`), src_pitch = shape[dim] * (the same), dst_pitch = row_bytes. Same rules as
  // copy(); Error(kInvalidArgument) when a pitch is smaller than row_bytes.
  void copy_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes, size_t rows,
               MemoryKind dst_kind, MemoryKind src_kind);

  // Returns once every copy issued so far is complete. Error(kTimeout) past the deadline (the
  // copies may still be running: keep the memory alive), Error(kTransport) when a copy failed.
  void synchronize(Deadline deadline);

  // Whether copies issued since the last synchronize() may still be running.
  bool pending() const;
  // The cudaStream_t (as void*) once a GPU copy created it, else null: callers may enqueue their
  // own work on it (e.g. a loader's kernels) to keep issue order.
  void* cuda_stream() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace refit
