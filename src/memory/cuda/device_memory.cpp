// DeviceBuffer (one cudaMalloc) and HostPin (cudaHostRegister), with the fallbacks of a build
// without CUDA: no device buffers, and pinning that does nothing. A HostPin unregisters only what
// it registered itself: memory that was page-locked already (by another HostPin over the same
// buffer, by UCX, by cudaMallocHost) is accepted as it is and left registered.
#include <utility>

#include "core/fail.h"
#include "memory/cuda/cuda_util.h"
#include "refit/device.h"
#include "refit/ext/device_memory.h"

namespace refit {

#ifdef REFIT_HAVE_CUDA

DeviceBuffer::DeviceBuffer(const Device& device, size_t bytes) {
  device_ = resolve_cuda_device(device);
  if (bytes == 0) return;
  cuda::DeviceGuard guard(device_);
  void* pointer = nullptr;
  cudaError_t status = cudaMalloc(&pointer, bytes);
  if (status != cudaSuccess) {
    cudaGetLastError();
    size_t free_bytes = 0, total_bytes = 0;
    std::string memory;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      memory = fmt::format(" ({} free of {})", cuda::gib(free_bytes), cuda::gib(total_bytes));
    } else {
      cudaGetLastError();
    }
    fail(ErrorKind::kTransport, "cannot allocate {} on cuda:{}{}: cudaMalloc: {}", cuda::gib(bytes), device_, memory,
         cuda::error_text(status));
  }
  // Zero-fill on a private non-blocking stream: neither the legacy default stream nor a device-wide
  // synchronize, which would wait for the caller's own GPU work.
  cudaStream_t stream = nullptr;
  const char* call = "cudaStreamCreateWithFlags";
  status = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (status == cudaSuccess) {
    call = "cudaMemsetAsync";
    status = cudaMemsetAsync(pointer, 0, bytes, stream);
    if (status == cudaSuccess) {
      call = "cudaStreamSynchronize";
      status = cudaStreamSynchronize(stream);
    }
    cudaStreamDestroy(stream);
  }
  if (status != cudaSuccess) {
    cudaFree(pointer);
    cuda::check(status, call, fmt::format("zero-filling {} bytes on cuda:{}", bytes, device_));
  }
  data_ = static_cast<std::byte*>(pointer);
  size_ = bytes;
}

void DeviceBuffer::release() noexcept {
  if (data_ != nullptr) {
    int previous = -1;
    const bool switched =
        cudaGetDevice(&previous) == cudaSuccess && previous != device_ && cudaSetDevice(device_) == cudaSuccess;
    cudaFree(data_);  // an error here (a dead context) leaves nothing we could free anyway
    if (switched) cudaSetDevice(previous);
    cudaGetLastError();
  }
  data_ = nullptr;
  size_ = 0;
}

namespace {

// Whether CUDA knows `pointer` as page-locked host memory (cudaHostRegister, cuMemHostRegister,
// cudaMallocHost), whoever made it so.
bool page_locked(const void* pointer) {
  cudaPointerAttributes attributes{};
  cudaError_t status = cudaPointerGetAttributes(&attributes, pointer);
  if (status != cudaSuccess) {
    cudaGetLastError();  // not a pointer CUDA knows: pageable
    return false;
  }
  return attributes.type == cudaMemoryTypeHost;
}

}  // namespace

bool pin_host_memory(void* base, size_t bytes, std::string* reason) {
  std::string why;
  if (cuda_device_count(&why) == 0) {
    if (reason != nullptr) *reason = "CUDA is not available: " + why;
    return false;
  }
  if (base == nullptr || bytes == 0) {
    if (reason != nullptr) *reason = "nothing to pin";
    return false;
  }
  // Someone may have page-locked (part of) it first: another pin of ours over the same buffer,
  // UCX's CUDA memory domain, cudaMallocHost (which cudaHostRegister refuses as an invalid value,
  // not as registered). That registration stays theirs to undo, so this pins nothing; the memory
  // is as page-locked as they made it.
  const auto* first = static_cast<const std::byte*>(base);
  const bool first_locked = page_locked(first), last_locked = page_locked(first + bytes - 1);
  cudaError_t status = cudaErrorHostMemoryAlreadyRegistered;
  if (!first_locked && !last_locked) status = cudaHostRegister(base, bytes, cudaHostRegisterPortable);
  if (status == cudaErrorHostMemoryAlreadyRegistered) {
    cudaGetLastError();
    if (reason != nullptr) {
      *reason = first_locked && last_locked
                    ? fmt::format(
                          "{} of host memory at {} is page-locked already (registered by someone else, who "
                          "unregisters it)",
                          cuda::gib(bytes), base)
                    : fmt::format(
                          "part of {} of host memory at {} is page-locked already by another registration; "
                          "the rest stays pageable (the driver stages copies of it)",
                          cuda::gib(bytes), base);
    }
    return false;
  }
  cuda::check(status, "cudaHostRegister", fmt::format("pinning {} of host memory at {}", cuda::gib(bytes), base));
  if (reason != nullptr) reason->clear();
  return true;
}

void unpin_host_memory(void* base) {
  cuda::check(cudaHostUnregister(base), "cudaHostUnregister", fmt::format("unpinning host memory at {}", base));
}

#else  // no CUDA in this build

DeviceBuffer::DeviceBuffer(const Device& device, size_t) {
  if (device.kind == Device::Kind::kCpu)
    fail(ErrorKind::kInvalidArgument, "a DeviceBuffer needs a CUDA device, got cpu (use HostBuffer)");
  check_device(device);
}

void DeviceBuffer::release() noexcept {
  data_ = nullptr;
  size_ = 0;
}

bool pin_host_memory(void*, size_t, std::string* reason) {
  if (reason != nullptr) *reason = "this build has no CUDA support";
  return false;
}

void unpin_host_memory(void*) {}

#endif  // REFIT_HAVE_CUDA

DeviceBuffer::~DeviceBuffer() { release(); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      device_(std::exchange(other.device_, -1)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    device_ = std::exchange(other.device_, -1);
  }
  return *this;
}

HostPin HostPin::pin(void* base, size_t bytes) {
  HostPin pin;
  if (pin_host_memory(base, bytes, &pin.reason_)) pin.base_ = base;
  return pin;
}

HostPin::~HostPin() { release(); }

HostPin::HostPin(HostPin&& other) noexcept
    : base_(std::exchange(other.base_, nullptr)), reason_(std::move(other.reason_)) {}

HostPin& HostPin::operator=(HostPin&& other) noexcept {
  if (this != &other) {
    release();
    base_ = std::exchange(other.base_, nullptr);
    reason_ = std::move(other.reason_);
  }
  return *this;
}

void HostPin::release() noexcept {
  if (base_ == nullptr) return;
  try {
    unpin_host_memory(base_);
  } catch (const std::exception&) {
    // Unpinning fails only with a broken CUDA context; the memory is freed by its owner anyway.
  }
  base_ = nullptr;
}

}  // namespace refit
