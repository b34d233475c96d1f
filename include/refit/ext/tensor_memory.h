// Extension tier (refit/ext/: for backends, benches and bindings built on refit, not for its
// users' programs). Memory for tensors wherever they live: host memory (page-locked when asked and a GPU is
// usable) or one allocation on a GPU. What the destination merges split tensors into, and where
// the bench keeps its weights and parameters.
#pragma once

#include <cstddef>

#include "refit/config.h"
#include "refit/device.h"
#include "refit/ext/device_memory.h"
#include "refit/memory.h"
#include "refit/tensor.h"

namespace refit {

class TensorMemory {
 public:
  TensorMemory() = default;
  // `bytes` zero-filled bytes of `kind`: a DeviceBuffer on `device` (plain "cuda": the current
  // GPU) for kCuda, a HostBuffer for kHost, page-locked if `pin` (HostPin: nothing without a
  // usable GPU). Throws as DeviceBuffer / HostBuffer do.
  TensorMemory(MemoryKind kind, const Device& device, size_t bytes, bool pin = false);
  TensorMemory(TensorMemory&& other) noexcept = default;
  // Unpins the memory it held before freeing it (a defaulted one would free first).
  TensorMemory& operator=(TensorMemory&& other) noexcept;

  std::byte* data() const { return device_.data() ? device_.data() : host_.data(); }
  size_t size() const { return device_.data() ? device_.size() : host_.size(); }

 private:
  HostBuffer host_;
  HostPin pin_;  // after host_: unpinned before it is freed
  DeviceBuffer device_;
};

}  // namespace refit
