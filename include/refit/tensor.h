// What refit knows about a tensor: its name, dtype and shape (TensorInfo), and where its bytes
// are (TensorView). refit never owns model tensors; views point at the caller's memory or at a
// transfer buffer and are valid only as long as the call that handed them out says.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "refit/dtype.h"

namespace refit {

struct TensorInfo {
  std::string name;
  DType dtype = DType::kUInt8;
  std::vector<int64_t> shape;

  uint64_t numel() const;
  uint64_t nbytes() const;
  bool operator==(const TensorInfo&) const = default;
};

// "[4096, 128]"
std::string shape_string(const std::vector<int64_t>& shape);

// Where bytes live. Device pointers come with the GPU data path.
enum class MemoryKind : uint8_t { kHost, kCuda };

// A contiguous, row-major tensor in memory refit does not own.
struct TensorView {
  const TensorInfo* info = nullptr;
  const std::byte* data = nullptr;
  MemoryKind memory = MemoryKind::kHost;
};

}  // namespace refit
