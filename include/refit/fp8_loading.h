// FP8 on the refit path (the reference's full-weight FP8 route and its KV-cache scales):
//  - a source appends the FP8 KV-cache scales after its weights (WeightSourceWithKvScales);
//  - a destination quantizes the bf16/fp32 weights it receives to float8_e4m3fn as they arrive
//    (Fp8QuantizingLoader), hands everything else through, collects the KV scales, and calls a
//    post-load hook once per refit, after the last batch.
// FP8 weights that the sources already hold reshard with their scales (fp8.h), and load into vLLM's
// fused FP8 expert storage with them (expert_loader.h).
#pragma once

#include <functional>
#include <map>
#include <string>

#include "refit/checkpoint_engine.h"
#include "refit/fp8.h"

namespace refit {

// Streams `weights`, then the scales (fp8.h: kv_scale_tensors).
class WeightSourceWithKvScales final : public WeightSource {
 public:
  WeightSourceWithKvScales(WeightSource& weights, KvScales scales);
  bool next(TensorView* out) override;
  bool views_outlive_send() const override { return weights_.views_outlive_send(); }  // the scales do

 private:
  WeightSource& weights_;
  KvScales scales_;
  bool weights_done_ = false;
  size_t next_scale_ = 0;
};

struct Fp8LoaderOptions {
  Fp8Scaling scaling = Fp8Scaling::kBlock128;
  // Which received tensors to quantize; default: is_fp8_linear_weight (fp8.h).
  std::function<bool(const TensorInfo&)> quantize;
  // Receives each quantized tensor (data and scales are valid during the call).
  std::function<void(const TensorInfo& source, const Fp8Tensor& quantized)> store_fp8;
  // Receives every other tensor except KV scales (the view is valid during the call).
  std::function<void(const TensorView& tensor)> store_other;
  // Called once per refit, after the last batch, with the KV scales received (may be empty).
  std::function<void(const std::map<std::string, float>& kv_scales)> post_load;
};

// True for the reference's KV-scale names (…self_attn.attn.q_scale, …self_attn.k_scale, …v_scale).
bool is_kv_scale_name(const std::string& name);

class Fp8QuantizingLoader {
 public:
  explicit Fp8QuantizingLoader(Fp8LoaderOptions options);
  // The loader to pass to CheckpointEngine::receive().
  BatchLoader loader();
  // After receive() returned: runs post_load with the scales of this refit, then resets.
  void finish_refit();

 private:
  void load(LoadBatch batch);
  Fp8LoaderOptions options_;
  std::map<std::string, float> kv_scales_;
};

}  // namespace refit
