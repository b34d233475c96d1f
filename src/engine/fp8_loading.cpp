#include "refit/fp8_loading.h"

#include <cstring>

#include "core/fail.h"

namespace refit {
WeightSourceWithKvScales::WeightSourceWithKvScales(WeightSource& weights, KvScales scales)
    : weights_(weights), scales_(std::move(scales)) {}

bool WeightSourceWithKvScales::next(TensorView* out) {
  if (!weights_done_) {
    if (weights_.next(out)) return true;
    weights_done_ = true;
  }
  if (next_scale_ == scales_.tensors.size()) return false;
  *out = {&scales_.tensors[next_scale_], reinterpret_cast<const std::byte*>(&scales_.values[next_scale_]),
          MemoryKind::kHost};
  ++next_scale_;
  return true;
}

bool is_kv_scale_name(const std::string& name) {
  return name.ends_with(".self_attn.attn.q_scale") || name.ends_with(".self_attn.k_scale") ||
         name.ends_with(".self_attn.v_scale");
}

Fp8QuantizingLoader::Fp8QuantizingLoader(Fp8LoaderOptions options) : options_(std::move(options)) {
  if (!options_.quantize) options_.quantize = is_fp8_linear_weight;
  if (!options_.store_fp8 || !options_.store_other)
    fail(ErrorKind::kInvalidArgument, "an FP8 loader needs store_fp8 and store_other callbacks");
}

BatchLoader Fp8QuantizingLoader::loader() {
  return [this](LoadBatch batch) { load(batch); };
}

void Fp8QuantizingLoader::load(LoadBatch batch) {
  for (const TensorView& v : batch) {
    const TensorInfo& info = *v.info;
    if (is_kv_scale_name(info.name)) {
      if (info.dtype != DType::kFloat32 || info.numel() != 1)
        fail(ErrorKind::kLayout, "KV-cache scale '{}' must be one float32, got {} {}", info.name,
             dtype_name(info.dtype), shape_string(info.shape));
      float value;
      std::memcpy(&value, v.data, sizeof(value));
      kv_scales_[info.name] = value;
    } else if (options_.quantize(info)) {
      options_.store_fp8(info, quantize_fp8(v.data, info, options_.scaling));
    } else {
      options_.store_other(v);
    }
  }
}

void Fp8QuantizingLoader::finish_refit() {
  if (options_.post_load) options_.post_load(kv_scales_);
  kv_scales_.clear();
}

}  // namespace refit
