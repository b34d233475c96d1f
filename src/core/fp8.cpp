#include "refit/fp8.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string_view>
#include <unordered_map>

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
  size_t used = 0;
  for (int64_t i = 0; i < num_layers; ++i) {
    for (const char* suffix : {"self_attn.attn.q_scale", "self_attn.k_scale", "self_attn.v_scale"}) {
      std::string name = fmt::format("model.layers.{}.{}", i, suffix);
      float value = 1.0f;
      if (auto it = given.find(name); it != given.end()) {
        value = it->second;
        ++used;
        // A KV cache quantized by NaN, infinity, zero or a negative scale is garbage that no later check sees.
        if (!std::isfinite(value) || value <= 0.0f)
          fail(ErrorKind::kInvalidArgument, "kv scale '{}' is {}: a KV-cache scale must be a finite number above 0",
               name, value);
      }
      out.values.push_back(value);
      out.tensors.push_back({std::move(name), DType::kFloat32, {1}});
    }
  }
  if (used < given.size())
    for (const auto& entry : given)
      if (std::none_of(out.tensors.begin(), out.tensors.end(),
                       [&](const TensorInfo& t) { return t.name == entry.first; }))
        out.ignored.push_back(entry.first);
  return out;
}

namespace {

bool is_float8(DType dtype) { return dtype == DType::kFloat8E4M3FN || dtype == DType::kFloat8E5M2; }

// Weight elements per scale element along a weight dim of `size` that the scale gives `scales`
// elements (0: not understood).
int64_t block_along(int64_t size, int64_t scales) {
  if (scales == size) return 1;
  if (scales == 1) return std::max<int64_t>(size, 1);
  if (scales == (size + kFp8BlockSize - 1) / kFp8BlockSize) return kFp8BlockSize;
  return 0;
}

}  // namespace

bool is_fp8_linear_weight(const TensorInfo& info) {
  const std::string& n = info.name;
  if (info.shape.size() != 2 || !n.ends_with(".weight")) return false;
  if (info.dtype != DType::kBFloat16 && info.dtype != DType::kFloat32) return false;
  for (std::string_view skip :
       {"embed_tokens", "lm_head", "norm", ".mlp.gate.weight", "block_sparse_moe.gate.", "shared_expert_gate"})
    if (n.find(skip) != std::string::npos) return false;
  return true;
}

ModelInventory fp8_block_inventory(const ModelInventory& model) {
  ModelInventory out;
  out.name = model.name + "-fp8";
  out.tensors.reserve(model.tensors.size() * 2);
  for (const auto& t : model.tensors) {
    if (!is_fp8_linear_weight(t)) {
      out.tensors.push_back(t);
      continue;
    }
    out.tensors.push_back({t.name, DType::kFloat8E4M3FN, t.shape});
    out.tensors.push_back({t.name + "_scale_inv", DType::kFloat32, fp8_scale_shape(t, Fp8Scaling::kBlock128)});
  }
  return out;
}

std::vector<Fp8ScaleOf> fp8_scales_of(const ModelInventory& model) {
  const auto& tensors = model.tensors;
  std::unordered_map<std::string_view, uint32_t> weights;  // 2-D float8 tensors by name
  for (uint32_t i = 0; i < tensors.size(); ++i)
    if (is_float8(tensors[i].dtype) && tensors[i].shape.size() == 2) weights.emplace(tensors[i].name, i);
  std::vector<Fp8ScaleOf> out;
  if (weights.empty()) return out;
  for (uint32_t i = 0; i < tensors.size(); ++i) {
    std::string_view name = tensors[i].name;
    for (std::string_view suffix : {"_scale_inv", "_scale"}) {
      if (!name.ends_with(suffix)) continue;
      auto it = weights.find(name.substr(0, name.size() - suffix.size()));
      if (it == weights.end()) continue;
      const auto& w = tensors[it->second].shape;
      const auto& s = tensors[i].shape;
      Fp8ScaleOf link{i, it->second, {}};
      if (s.size() == 2) {
        link.block = {block_along(w[0], s[0]), block_along(w[1], s[1])};
      } else if (s.empty() || (s.size() == 1 && s[0] == 1)) {  // per tensor
        link.block = {std::max<int64_t>(w[0], 1), std::max<int64_t>(w[1], 1)};
      } else if (s.size() == 1 && s[0] == w[0]) {  // per channel, [R]
        link.block = {1, std::max<int64_t>(w[1], 1)};
      }
      out.push_back(link);
      break;
    }
  }
  return out;
}

Request fp8_scale_request(const ModelInventory& model, const Fp8ScaleOf& link, const Request& weight,
                          std::string_view owner) {
  if (weight.take != Take::kSlice) return weight;
  const TensorInfo& w = model.tensors[link.weight];
  const TensorInfo& s = model.tensors[link.scale];
  const Slice& cut = weight.slice;
  if (cut.dim < 0 || cut.dim > 1)
    fail(ErrorKind::kLayout, "layout of {}: FP8 weight '{}' is sliced along dim {}, which a 2-D weight lacks", owner,
         w.name, cut.dim);
  const int64_t block = link.block[cut.dim], size = w.shape[cut.dim];
  if (block == 0)
    fail(ErrorKind::kLayout,
         "layout of {}: FP8 weight '{}' {} is sliced, but its scale '{}' of shape {} is neither per tensor, per "
         "channel nor in {} x {} blocks, so which scales go with the slice is unknown",
         owner, w.name, shape_string(w.shape), s.name, shape_string(s.shape), kFp8BlockSize, kFp8BlockSize);
  if (block >= size && size > 0) return Request::whole();  // the scale does not split this dim
  const int64_t end = cut.start + cut.length;
  for (int64_t edge : {cut.start, end})
    if (edge % block != 0 && edge != size)
      fail(ErrorKind::kLayout,
           "layout of {}: FP8 weight '{}' slice dim {} [{}, {}) cuts through scale block {} (elements [{}, {})) of "
           "'{}': a holder of the slice would need a scale shared with another holder's elements; use parallel "
           "sizes that split dim {} (size {}) at multiples of {}",
           owner, w.name, cut.dim, cut.start, end, edge / block, edge / block * block,
           std::min(edge / block * block + block, size), s.name, cut.dim, size, block);
  // Here the scale splits the dim, so it has one (a per-channel [R]: dim 0) or two dims.
  const int64_t first = cut.start / block, last = (end + block - 1) / block;
  if (first == 0 && last == s.shape[cut.dim]) return Request::whole();
  return Request::narrow(cut.dim, first, last - first);
}

}  // namespace refit
