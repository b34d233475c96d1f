// FP8 (float8_e4m3fn) weights and FP8 KV-cache scales.
//
// Quantization follows DeepSeek-V3 / DeepGEMM's per_block_cast_to_fp8, the convention vLLM's
// block-FP8 layers load: per scaling group, amax = max |x| in float32, clamped to at least
// 1e-4; q = e4m3fn(x * (448 / amax)), rounded to nearest even and saturated at +-448; the
// stored scale (DeepSeek's `weight_scale_inv`, a dequantization multiplier) is amax / 448, so
// x ~ q * scale. Groups: the whole tensor (per-tensor), or 128 x 128 blocks of a 2-D tensor
// (edge blocks are partial), giving scales of shape [ceil(M/128), ceil(N/128)].
//
// FP8 checkpoints (DeepSeek-V3, Qwen3 FP8) store each linear weight as float8_e4m3fn next to its
// scales, "<weight>_scale_inv". When a weight is sliced (a TP shard, a destination's slice), its
// scale must be sliced with it: the scale blocks the slice covers, and a slice that starts or
// ends inside a block cannot be served at all (vLLM refuses such a partition too).
//
// KV-cache scales: the reference appends, after all weights and for every decoder layer i,
// model.layers.{i}.self_attn.attn.q_scale, model.layers.{i}.self_attn.k_scale and
// model.layers.{i}.self_attn.v_scale: float32 of shape [1], the value given for that name or
// 1.0. They travel as ordinary tensors and pass through a layout like any other name.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "refit/layout.h"
#include "refit/model.h"
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

// What FP8 linear layers hold: 2-D bfloat16/float32 "*.weight" tensors other than embeddings,
// lm_head, norms and routers (the default choice of Fp8QuantizingLoader and fp8_block_inventory).
bool is_fp8_linear_weight(const TensorInfo& info);

// The same model stored as DeepSeek-V3's and Qwen3's FP8 checkpoints store it: every
// is_fp8_linear_weight tensor becomes float8_e4m3fn, followed by "<name>_scale_inv" (float32,
// its 128 x 128 block scales, fp8_scale_shape). Other tensors are unchanged.
ModelInventory fp8_block_inventory(const ModelInventory& model);

// A scale tensor and the FP8 weight it scales. A tensor named "<w>_scale_inv" or "<w>_scale" is
// the scale of "<w>" when <w> is a 2-D float8 tensor of the same model. Along weight dim d one
// scale element covers block[d] weight elements: 128 for block scales ([ceil(R/128),
// ceil(C/128)]), 1 per channel ([R, 1] or [R]), the whole dim where the scale has size 1 ([1]
// or [] per tensor). block[d] == 0: a shape none of these explains; the weight can go whole only.
struct Fp8ScaleOf {
  uint32_t scale = 0;  // inventory indices
  uint32_t weight = 0;
  std::array<int64_t, 2> block{};
};
// Every scale of `model`, in inventory order of the scales.
std::vector<Fp8ScaleOf> fp8_scales_of(const ModelInventory& model);

// What goes with `weight` of the scale `link` describes: drop with drop, whole with whole, and
// with a slice the scale blocks it covers (whole along a dim the scale does not split). Throws
// Error(kLayout) naming `owner`, the weight, its slice, the scale and the block that the slice
// starts or ends inside of, or the scale's shape when it is not understood.
Request fp8_scale_request(const ModelInventory& model, const Fp8ScaleOf& link, const Request& weight,
                          std::string_view owner);

struct KvScales {
  std::vector<TensorInfo> tensors;   // in the reference's order, layer by layer: q, k, v
  std::vector<float> values;         // one per tensor
  std::vector<std::string> ignored;  // names given that are no scale of these layers
};
// Scales for `num_layers` decoder layers; names absent from `given` get 1.0, and names in
// `given` that are not scale names of these layers are ignored (as the reference does) and listed
// in `ignored`, for the caller to warn of. Throws Error(kInvalidArgument) naming a scale that is
// not a finite number above zero: the KV cache would be quantized by it.
KvScales kv_scale_tensors(int64_t num_layers, const std::map<std::string, float>& given);

}  // namespace refit
