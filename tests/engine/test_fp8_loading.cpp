#include <gtest/gtest.h>

#include <cmath>
#include <future>

#include "engine_harness.h"
#include "refit/error.h"
#include "refit/fp8_loading.h"

namespace refit {
namespace {

using testing::inproc_options;
using testing::OwnedTensor;
using testing::VectorSource;

OwnedTensor bf16_tensor(std::string name, std::vector<int64_t> shape, float scale) {
  OwnedTensor t{{std::move(name), DType::kBFloat16, std::move(shape)}, {}};
  t.data.resize(t.info.nbytes());
  auto* p = reinterpret_cast<uint16_t*>(t.data.data());
  for (uint64_t i = 0; i < t.info.numel(); ++i) p[i] = bf16_from_float(scale * std::sin(0.37f * i + 1));
  return t;
}

TEST(Fp8Loading, FullWeightRefitQuantizesLinearWeightsAndCarriesKvScales) {
  auto fabric = make_inproc_fabric();
  auto session = new_session_id();
  CheckpointEngine source(inproc_options(fabric, 4096, session)), destination(inproc_options(fabric, 4096, session));
  std::vector<Metadata> md = {source.prepare(), destination.prepare()};
  source.init_source(0, 1, 1, md);
  destination.init_destination(0, 1, 1, md);

  std::vector<OwnedTensor> weights = {
      bf16_tensor("model.embed_tokens.weight", {64, 32}, 1.0f),                 // kept as is
      bf16_tensor("model.layers.0.self_attn.q_proj.weight", {200, 130}, 3.0f),  // quantized, partial blocks
      bf16_tensor("model.layers.0.input_layernorm.weight", {32}, 1.0f),         // kept as is
      bf16_tensor("model.layers.1.mlp.down_proj.weight", {40, 300}, 0.01f),     // quantized
  };
  auto scales = kv_scale_tensors(2, {{"model.layers.1.self_attn.k_scale", 0.25f}});

  std::map<std::string, Fp8Tensor> fp8;
  std::map<std::string, std::vector<std::byte>> other;
  std::vector<std::map<std::string, float>> post_loads;
  Fp8QuantizingLoader loader(
      {Fp8Scaling::kBlock128,
       {},
       [&](const TensorInfo& info, const Fp8Tensor& q) { fp8[info.name] = q; },
       [&](const TensorView& v) { other[v.info->name].assign(v.data, v.data + v.info->nbytes()); },
       [&](const std::map<std::string, float>& kv) { post_loads.push_back(kv); }});

  auto sent = std::async(std::launch::async, [&] {
    VectorSource plain(weights);
    WeightSourceWithKvScales with_scales(plain, scales);
    return source.send(with_scales);
  });
  auto stats = destination.receive(loader.loader());
  sent.get();
  loader.finish_refit();

  EXPECT_EQ(stats.tensors, weights.size() + 6);
  ASSERT_EQ(fp8.size(), 2u);
  for (const auto& w : weights) {
    if (!is_fp8_linear_weight(w.info)) {
      EXPECT_EQ(other.at(w.info.name), w.data) << w.info.name;
      continue;
    }
    const Fp8Tensor expected = quantize_fp8(w.data.data(), w.info, Fp8Scaling::kBlock128);
    EXPECT_EQ(fp8.at(w.info.name).data, expected.data) << w.info.name;
    EXPECT_EQ(fp8.at(w.info.name).scales, expected.scales) << w.info.name;
  }
  ASSERT_EQ(post_loads.size(), 1u);  // once per refit, after the last batch
  ASSERT_EQ(post_loads[0].size(), 6u);
  EXPECT_EQ(post_loads[0].at("model.layers.1.self_attn.k_scale"), 0.25f);
  EXPECT_EQ(post_loads[0].at("model.layers.0.self_attn.attn.q_scale"), 1.0f);
  EXPECT_EQ(other.count("model.layers.0.self_attn.v_scale"), 0u);
}

TEST(Fp8Loading, MalformedKvScaleIsRejected) {
  Fp8QuantizingLoader loader(
      {Fp8Scaling::kPerTensor, {}, [](const TensorInfo&, const Fp8Tensor&) {}, [](const TensorView&) {}, {}});
  TensorInfo bad{"model.layers.0.self_attn.k_scale", DType::kFloat32, {2}};
  float values[2] = {1, 2};
  TensorView v{&bad, reinterpret_cast<const std::byte*>(values), MemoryKind::kHost};
  try {
    loader.loader()({&v, 1});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("k_scale"), std::string::npos);
  }
}

}  // namespace
}  // namespace refit
