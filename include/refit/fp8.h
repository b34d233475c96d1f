// FP8 (float8_e4m3fn) weights and FP8 KV-cache scales.
//
// Quantization follows DeepSeek-V3 / DeepGEMM's per_block_cast_to_fp8, the convention vLLM's
// block-FP8 layers load: per scaling group, amax = max |x| in float32, clamped to at least
// 1e-4; q = e4m3fn(x * (448 / amax)), rounded to nearest even and saturated at +-448; the
// stored scale (DeepSeek's `weight_scale_inv`, a dequantization multiplier) is amax / 448, so
// x ~ q * scale. Groups: the whole tensor (per-tensor), or 128 x 128 blocks of a 2-D tensor
// (edge blocks are partial), giving scales of shape [ceil(M/128), ceil(N/128)].
//
// KV-cache scales: the reference appends, after all weights and for every decoder layer i,
// model.layers.{i}.self_attn.attn.q_scale, model.layers.{i}.self_attn.k_scale and
// model.layers.{i}.self_attn.v_scale: float32 of shape [1], the value given for that name or
// 1.0. They travel as ordinary tensors and pass through a layout like any other name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "refit/tensor.h"

namespace refit {

inline constexpr float kFp8E4M3Max = 448.0f;
inline constexpr int64_t kFp8BlockSize = 128;

// Scalar conversions. to-fp8 rounds to nearest even, saturates at +-448 (infinities too) and
// keeps NaN as NaN (0x7f with the sign).
uint8_t fp8_e4m3fn_from_float(float value);
float fp8_e4m3fn_to_float(uint8_t code);
float bf16_to_float(uint16_t bits);
uint16_t bf16_from_float(float value);  // round to nearest even

enum class Fp8Scaling { kPerTensor, kBlock128 };

// Scale tensor shape: [1] per-tensor, [ceil(M/128), ceil(N/128)] for blocks (2-D tensors only;
// Error(kInvalidArgument) otherwise).
std::vector<int64_t> fp8_scale_shape(const TensorInfo& info, Fp8Scaling scaling);

// Quantizes the contiguous bfloat16 or float32 tensor at `src` into `dst` (numel bytes) and
// `scales` (fp8_scale_shape elements, float32). Error(kInvalidArgument) naming the tensor for
// another dtype, a non-2-D tensor with block scaling, or a non-finite value.
void quantize_fp8(const std::byte* src, const TensorInfo& info, Fp8Scaling scaling, uint8_t* dst, float* scales);

struct Fp8Tensor {
  std::vector<uint8_t> data;
  std::vector<float> scales;
  std::vector<int64_t> scale_shape;
};
Fp8Tensor quantize_fp8(const std::byte* src, const TensorInfo& info, Fp8Scaling scaling);

struct KvScales {
  std::vector<TensorInfo> tensors;  // in the reference's order, layer by layer: q, k, v
  std::vector<float> values;        // one per tensor
};
// Scales for `num_layers` decoder layers; names absent from `given` get 1.0, and names in
// `given` that are not scale names of these layers are ignored (as the reference does).
KvScales kv_scale_tensors(int64_t num_layers, const std::map<std::string, float>& given);

// The reference rejects the sharded-expert path for FP8 models (V40): Error(kUnsupported)
// naming the destination rank when both are set.
void check_sharded_experts_not_fp8(bool shard_expert_weights, bool fp8_model, int destination_rank);

}  // namespace refit
