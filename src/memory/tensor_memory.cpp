#include "refit/ext/tensor_memory.h"
#include "refit/ext/device_memory.h"

#include <utility>

namespace refit {

TensorMemory::TensorMemory(MemoryKind kind, const Device& device, size_t bytes, bool pin) {
  if (kind == MemoryKind::kCuda) {
    device_ = DeviceBuffer(device, bytes);
    return;
  }
  host_ = HostBuffer(bytes);
  if (pin) pin_ = HostPin::pin(host_.data(), bytes);
}

TensorMemory& TensorMemory::operator=(TensorMemory&& other) noexcept {
  if (this == &other) return *this;
  pin_ = HostPin();
  host_ = std::move(other.host_);
  pin_ = std::move(other.pin_);
  device_ = std::move(other.device_);
  return *this;
}

}  // namespace refit
