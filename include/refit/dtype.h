// Element types of model tensors, with their sizes and names. Names follow PyTorch
// ("bfloat16"); parsing also accepts the safetensors spellings ("BF16", "F8_E4M3").
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

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

// The dtype of a C++ element type: bool, the fixed-width integers that have one, float, double.
template <class T>
constexpr DType dtype_of() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, bool>)
    return DType::kBool;
  else if constexpr (std::is_same_v<U, uint8_t>)
    return DType::kUInt8;
  else if constexpr (std::is_same_v<U, int8_t>)
    return DType::kInt8;
  else if constexpr (std::is_same_v<U, int16_t>)
    return DType::kInt16;
  else if constexpr (std::is_same_v<U, int32_t>)
    return DType::kInt32;
  else if constexpr (std::is_same_v<U, int64_t>)
    return DType::kInt64;
  else if constexpr (std::is_same_v<U, float>)
    return DType::kFloat32;
  else if constexpr (std::is_same_v<U, double>)
    return DType::kFloat64;
  else
    static_assert(sizeof(U) == 0, "no refit::DType for this C++ type (16-bit and 8-bit floats have none)");
}

}  // namespace refit
