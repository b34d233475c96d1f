#include "refit/dtype.h"

#include <array>
#include <string>

#include "core/fail.h"

namespace refit {
namespace {

struct DTypeNames {
  DType dtype;
  size_t size;
  std::string_view torch;
  std::string_view safetensors;
};

constexpr std::array<DTypeNames, kDTypeCount> kNames = {{
    {DType::kBool, 1, "bool", "BOOL"},
    {DType::kUInt8, 1, "uint8", "U8"},
    {DType::kInt8, 1, "int8", "I8"},
    {DType::kInt16, 2, "int16", "I16"},
    {DType::kInt32, 4, "int32", "I32"},
    {DType::kInt64, 8, "int64", "I64"},
    {DType::kFloat16, 2, "float16", "F16"},
    {DType::kBFloat16, 2, "bfloat16", "BF16"},
    {DType::kFloat32, 4, "float32", "F32"},
    {DType::kFloat64, 8, "float64", "F64"},
    {DType::kFloat8E4M3FN, 1, "float8_e4m3fn", "F8_E4M3"},
    {DType::kFloat8E5M2, 1, "float8_e5m2", "F8_E5M2"},
}};

const DTypeNames& entry(DType dtype) {
  auto index = static_cast<size_t>(dtype);
  if (index >= kNames.size()) fail(ErrorKind::kInvalidArgument, "invalid dtype code {}", index);
  return kNames[index];
}

}  // namespace

size_t dtype_size(DType dtype) { return entry(dtype).size; }
std::string_view dtype_name(DType dtype) { return entry(dtype).torch; }
std::string_view dtype_safetensors_name(DType dtype) { return entry(dtype).safetensors; }

DType parse_dtype(std::string_view name) {
  if (name.starts_with("torch.")) name.remove_prefix(6);
  for (const auto& n : kNames) {
    if (name == n.torch || name == n.safetensors) return n.dtype;
  }
  struct Alias {
    std::string_view name;
    DType dtype;
  };
  static constexpr Alias kAliases[] = {
      {"bf16", DType::kBFloat16},    {"fp16", DType::kFloat16}, {"half", DType::kFloat16},
      {"float", DType::kFloat32},    {"fp32", DType::kFloat32}, {"double", DType::kFloat64},
      {"fp8", DType::kFloat8E4M3FN}, {"long", DType::kInt64},   {"int", DType::kInt32},
  };
  for (const auto& a : kAliases) {
    if (name == a.name) return a.dtype;
  }
  fail(ErrorKind::kInvalidArgument, "unknown dtype '{}'", name);
}

}  // namespace refit
