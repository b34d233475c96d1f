#include "refit/fp8.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/fail.h"

namespace refit {
namespace {

// Reads element i of a bfloat16 or float32 buffer as float.
template <DType D>
float load(const std::byte* src, uint64_t i) {
  if constexpr (D == DType::kBFloat16) {
    uint16_t bits;
    std::memcpy(&bits, src + 2 * i, 2);
    return bf16_to_float(bits);
  } else {
    float v;
    std::memcpy(&v, src + 4 * i, 4);
    return v;
  }
}

// One scaling group: rows [r0, r1) x cols [c0, c1) of a row-major [rows, cols] matrix.
template <DType D>
float quantize_group(const std::byte* src, const TensorInfo& info, uint64_t cols, uint64_t r0, uint64_t r1, uint64_t c0,
                     uint64_t c1, uint8_t* dst) {
  float amax = 0.0f;
  for (uint64_t r = r0; r < r1; ++r)
    for (uint64_t c = c0; c < c1; ++c) {
      float v = load<D>(src, r * cols + c);
      if (!std::isfinite(v))
        fail(ErrorKind::kInvalidArgument, "cannot quantize tensor '{}' to fp8: element {} is {}", info.name,
             r * cols + c, v);
      amax = std::max(amax, std::fabs(v));
    }
  amax = std::max(amax, 1e-4f);  // DeepGEMM's clamp: an all-zero group gets a finite scale
  const float inv = kFp8E4M3Max / amax;
  for (uint64_t r = r0; r < r1; ++r)
    for (uint64_t c = c0; c < c1; ++c) dst[r * cols + c] = fp8_e4m3fn_from_float(load<D>(src, r * cols + c) * inv);
  return amax / kFp8E4M3Max;
}

template <DType D>
void quantize_typed(const std::byte* src, const TensorInfo& info, Fp8Scaling scaling, uint8_t* dst, float* scales) {
  if (scaling == Fp8Scaling::kPerTensor) {
    scales[0] = quantize_group<D>(src, info, info.numel(), 0, 1, 0, info.numel(), dst);
    return;
  }
  const auto rows = static_cast<uint64_t>(info.shape[0]), cols = static_cast<uint64_t>(info.shape[1]);
  const uint64_t block = kFp8BlockSize;
  const uint64_t block_cols = (cols + block - 1) / block;
  for (uint64_t br = 0; br * block < rows; ++br)
    for (uint64_t bc = 0; bc < block_cols; ++bc)
      scales[br * block_cols + bc] = quantize_group<D>(src, info, cols, br * block, std::min(rows, (br + 1) * block),
                                                       bc * block, std::min(cols, (bc + 1) * block), dst);
}

}  // namespace

uint8_t fp8_e4m3fn_from_float(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const auto sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return sign | 0x7f;  // NaN
  const float a = std::bit_cast<float>(abs_bits);
  if (a >= kFp8E4M3Max) return sign | 0x7e;  // saturate (448 = 0x7e; 0x7f is NaN)
  if (abs_bits < 0x3c800000u) {
    // Below 2^-6, the smallest normal: subnormals in steps of 2^-9. The scaling is exact; a
    // result of 8 is the smallest normal, whose code is also 8.
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));
  }
  // Round the 23-bit mantissa to 3 bits, to nearest even; a carry bumps the exponent.
  const uint32_t rounded = (abs_bits + 0x7ffffu + ((abs_bits >> 20) & 1u)) >> 20;
  return sign | static_cast<uint8_t>(rounded - (120u << 3));  // rebias the exponent 127 -> 7
}

float fp8_e4m3fn_to_float(uint8_t code) {
  const int exponent = (code >> 3) & 0xf, mantissa = code & 7;
  float v;
  if (exponent == 15 && mantissa == 7)
    v = std::numeric_limits<float>::quiet_NaN();
  else if (exponent == 0)
    v = std::ldexp(static_cast<float>(mantissa), -9);
  else
    v = std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
  return (code & 0x80) ? -v : v;
}

float bf16_to_float(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

uint16_t bf16_from_float(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

std::vector<int64_t> fp8_scale_shape(const TensorInfo& info, Fp8Scaling scaling) {
  if (scaling == Fp8Scaling::kPerTensor) return {1};
  if (info.shape.size() != 2)
    fail(ErrorKind::kInvalidArgument, "fp8 block scaling of tensor '{}' needs a 2-D tensor, got shape {}", info.name,
         shape_string(info.shape));
  return {(info.shape[0] + kFp8BlockSize - 1) / kFp8BlockSize, (info.shape[1] + kFp8BlockSize - 1) / kFp8BlockSize};
}

void quantize_fp8(const std::byte* src, const TensorInfo& info, Fp8Scaling scaling, uint8_t* dst, float* scales) {
  fp8_scale_shape(info, scaling);  // validates the rank
  switch (info.dtype) {
    case DType::kBFloat16:
      return quantize_typed<DType::kBFloat16>(src, info, scaling, dst, scales);
    case DType::kFloat32:
      return quantize_typed<DType::kFloat32>(src, info, scaling, dst, scales);
    default:
      fail(ErrorKind::kInvalidArgument, "cannot quantize tensor '{}' to fp8: dtype {} (expected bfloat16 or float32)",
           info.name, dtype_name(info.dtype));
  }
}

Fp8Tensor quantize_fp8(const std::byte* src, const TensorInfo& info, Fp8Scaling scaling) {
  Fp8Tensor out;
  out.scale_shape = fp8_scale_shape(info, scaling);
  out.data.resize(info.numel());
  uint64_t scales = 1;
  for (int64_t d : out.scale_shape) scales *= static_cast<uint64_t>(d);
  out.scales.resize(scales);
  quantize_fp8(src, info, scaling, out.data.data(), out.scales.data());
  return out;
}

KvScales kv_scale_tensors(int64_t num_layers, const std::map<std::string, float>& given) {
  if (num_layers < 0) fail(ErrorKind::kInvalidArgument, "kv scales: num_layers {} is negative", num_layers);
  KvScales out;
  for (int64_t i = 0; i < num_layers; ++i) {
    for (const char* suffix : {"self_attn.attn.q_scale", "self_attn.k_scale", "self_attn.v_scale"}) {
      std::string name = fmt::format("model.layers.{}.{}", i, suffix);
      auto it = given.find(name);
      out.values.push_back(it == given.end() ? 1.0f : it->second);
      out.tensors.push_back({std::move(name), DType::kFloat32, {1}});
    }
  }
  return out;
}

void check_sharded_experts_not_fp8(bool shard_expert_weights, bool fp8_model, int destination_rank) {
  if (shard_expert_weights && fp8_model)
    fail(ErrorKind::kUnsupported,
         "Sharded NIXL expert refit is not supported for FP8 vLLM models (destination rank {}); set "
         "shard_expert_weights=false to refit FP8 models through the full-weight path.",
         destination_rank);
}

}  // namespace refit
