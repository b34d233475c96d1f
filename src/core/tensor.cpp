#include "refit/tensor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/fail.h"

namespace refit {

uint64_t TensorInfo::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0)
      fail(ErrorKind::kInvalidArgument, "tensor '{}' has a negative dimension in shape {}", name, shape_string(shape));
    n *= static_cast<uint64_t>(d);
  }
  return n;
}

uint64_t TensorInfo::nbytes() const { return numel() * dtype_size(dtype); }

std::string shape_string(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

}  // namespace refit
