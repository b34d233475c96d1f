// Run-time GPU detection and capacity (include/refit/device.h), with the CPU-only fallbacks of a
// build without CUDA.
#include <cstdlib>
#include <string>

#include "core/fail.h"
#include "memory/cuda/cuda_util.h"
#include "refit/device.h"
#include "refit/memory.h"

#ifdef REFIT_HAVE_CUDA
#include <chrono>
#include <thread>
#endif

namespace refit {
namespace {

constexpr const char* kNoCudaBuild =
    "this build has no CUDA support; rebuild with REFIT_WITH_CUDA=ON or use device=cpu";

std::string format_gib(uint64_t bytes) { return fmt::format("{:.1f} GiB", static_cast<double>(bytes) / (1ull << 30)); }

[[maybe_unused]] std::string visible_devices_note() {
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  return visible != nullptr ? fmt::format(" (CUDA_VISIBLE_DEVICES={})", visible) : std::string();
}

// `count` transfer buffers of `bytes` (`needed` in all) against this host's memory.
void check_host_fit(uint64_t bytes, int count, uint64_t needed) {
  const uint64_t total = total_host_memory_bytes();
  if (needed > total) {
    fail(ErrorKind::kConfig,
         "this host has {} of memory; {} transfer buffers of {} need {}: lower "
         "update_weights_bucket_memory_ratio or set bucket_bytes",
         format_gib(total), count, format_gib(bytes), format_gib(needed));
  }
}

}  // namespace

#ifdef REFIT_HAVE_CUDA

namespace cuda {

std::string error_text(cudaError_t error) {
  return fmt::format("{}: {}", cudaGetErrorName(error), cudaGetErrorString(error));
}

void check(cudaError_t error, std::string_view call, std::string_view what, ErrorKind kind) {
  if (error == cudaSuccess) return;
  cudaGetLastError();  // clear the runtime's last error (sticky errors stay, as they must)
  if (what.empty()) fail(kind, "{}: {}", call, error_text(error));
  fail(kind, "{}: {}: {}", what, call, error_text(error));
}

std::string gib(uint64_t bytes) { return format_gib(bytes); }

DeviceGuard::DeviceGuard(int device) {
  int current = -1;
  check(cudaGetDevice(&current), "cudaGetDevice");
  if (current != device) {
    check(cudaSetDevice(device), "cudaSetDevice", fmt::format("selecting cuda:{}", device));
    previous_ = current;
  }
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

void poll_pause(uint64_t& spins) {
  if (++spins < 64) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

void wait_stream(cudaStream_t stream, Deadline deadline, std::string_view what) {
  uint64_t spins = 0;
  while (true) {
    cudaError_t status = cudaStreamQuery(stream);
    if (status == cudaSuccess) return;
    if (status != cudaErrorNotReady) check(status, "cudaStreamQuery", what);
    if (expired(deadline)) fail(ErrorKind::kTimeout, "timed out {} (the GPU copy had not finished)", what);
    poll_pause(spins);
  }
}

}  // namespace cuda

bool cuda_built() { return true; }

int cuda_device_count(std::string* reason) {
  int count = 0;
  cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();
    if (reason != nullptr) *reason = cudaGetErrorString(status);
    return 0;
  }
  if (count <= 0) {
    if (reason != nullptr) *reason = "no CUDA device found";
    return 0;
  }
  if (reason != nullptr) reason->clear();
  return count;
}

void check_device(const Device& device) {
  if (device.kind == Device::Kind::kCpu) return;
  std::string reason;
  const int count = cuda_device_count(&reason);
  if (count == 0) {
    fail(ErrorKind::kUnsupported,
         "device {} requested but CUDA is not available: {}{}; check the GPU driver (nvidia-smi), or use device cpu",
         to_string(device), reason, visible_devices_note());
  }
  if (device.index < -1 || device.index >= count) {
    fail(ErrorKind::kConfig, "device {} requested but this machine has {} GPU{} (indices 0..{}){}", to_string(device),
         count, count == 1 ? "" : "s", count - 1, visible_devices_note());
  }
}

int resolve_cuda_device(const Device& device) {
  if (device.kind == Device::Kind::kCpu) fail(ErrorKind::kInvalidArgument, "device cpu has no CUDA device index");
  check_device(device);
  if (device.index >= 0) return device.index;
  int current = 0;
  cuda::check(cudaGetDevice(&current), "cudaGetDevice", "finding the current CUDA device");
  return current;
}

void set_current_device(const Device& device) {
  if (device.kind == Device::Kind::kCpu || device.index < 0) return;
  check_device(device);
  cuda::check(cudaSetDevice(device.index), "cudaSetDevice", fmt::format("selecting {}", to_string(device)));
}

uint64_t total_device_memory_bytes(const Device& device) {
  if (device.kind == Device::Kind::kCpu) return total_host_memory_bytes();
  const int index = resolve_cuda_device(device);
  cudaDeviceProp properties{};
  cuda::check(cudaGetDeviceProperties(&properties, index), "cudaGetDeviceProperties",
              fmt::format("reading the memory size of cuda:{}", index));
  return properties.totalGlobalMem;
}

void check_buffers_fit(const Device& device, uint64_t bytes, int count) {
  uint64_t needed = 0;
  if (count < 0 || __builtin_mul_overflow(bytes, static_cast<uint64_t>(count), &needed))
    fail(ErrorKind::kConfig, "{} transfer buffers of {} bytes do not fit in any memory", count, bytes);
  if (device.kind == Device::Kind::kCpu) return check_host_fit(bytes, count, needed);
  const int index = resolve_cuda_device(device);
  cuda::DeviceGuard guard(index);
  size_t free_bytes = 0, total_bytes = 0;
  cuda::check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo",
              fmt::format("reading the free memory of cuda:{}", index));
  if (needed > free_bytes) {
    fail(ErrorKind::kConfig,
         "device cuda:{} has {} free of {}; {} transfer buffers of {} need {}: lower "
         "update_weights_bucket_memory_ratio or set bucket_bytes",
         index, format_gib(free_bytes), format_gib(total_bytes), count, format_gib(bytes), format_gib(needed));
  }
}

MemoryKind memory_kind_of(const void* pointer) {
  if (pointer == nullptr) return MemoryKind::kHost;
  cudaPointerAttributes attributes{};
  cudaError_t status = cudaPointerGetAttributes(&attributes, pointer);
  if (status != cudaSuccess) {
    cudaGetLastError();
    return MemoryKind::kHost;
  }
  return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged ? MemoryKind::kCuda
                                                                                             : MemoryKind::kHost;
}

#else  // no CUDA in this build

bool cuda_built() { return false; }

int cuda_device_count(std::string* reason) {
  if (reason != nullptr) *reason = kNoCudaBuild;
  return 0;
}

void check_device(const Device& device) {
  if (device.kind == Device::Kind::kCpu) return;
  fail(ErrorKind::kUnsupported, "device {} requested but {}", to_string(device), kNoCudaBuild);
}

int resolve_cuda_device(const Device& device) {
  if (device.kind == Device::Kind::kCpu) fail(ErrorKind::kInvalidArgument, "device cpu has no CUDA device index");
  check_device(device);
  return -1;  // not reached
}

void set_current_device(const Device& device) { check_device(device); }

uint64_t total_device_memory_bytes(const Device& device) {
  check_device(device);
  return total_host_memory_bytes();
}

void check_buffers_fit(const Device& device, uint64_t bytes, int count) {
  check_device(device);
  uint64_t needed = 0;
  if (count < 0 || __builtin_mul_overflow(bytes, static_cast<uint64_t>(count), &needed))
    fail(ErrorKind::kConfig, "{} transfer buffers of {} bytes do not fit in any memory", count, bytes);
  check_host_fit(bytes, count, needed);
}

MemoryKind memory_kind_of(const void*) { return MemoryKind::kHost; }

#endif  // REFIT_HAVE_CUDA

}  // namespace refit
