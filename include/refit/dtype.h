// Element types of model tensors, with their sizes and names. Names follow PyTorch
// ("bfloat16"); parsing also accepts the safetensors spellings ("BF16", "F8_E4M3").
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace refit {

enum class DType : uint8_t {
  kBool,
  kUInt8,
  kInt8,
  kInt16,
  kInt32,
  kInt64,
  kFloat16,
  kBFloat16,
  kFloat32,
  kFloat64,
  kFloat8E4M3FN,
  kFloat8E5M2,
};

inline constexpr int kDTypeCount = 12;

// Bytes per element; also the alignment a chunk of this dtype gets inside a bucket.
size_t dtype_size(DType dtype);

// PyTorch name, e.g. "bfloat16", "float8_e4m3fn".
std::string_view dtype_name(DType dtype);

// safetensors name, e.g. "BF16", "F8_E4M3".
std::string_view dtype_safetensors_name(DType dtype);

// Accepts PyTorch names (with or without "torch."), safetensors names and the usual
// config.json spellings ("bf16", "fp16", "float"). Throws Error(kInvalidArgument).
DType parse_dtype(std::string_view name);

}  // namespace refit
