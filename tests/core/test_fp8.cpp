#include "refit/fp8.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "core/error_of.h"
#include "refit/error.h"

namespace refit {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

using testing::error_of;

// e4m3fn by definition: bias 7, subnormals at exponent 0, no infinities, S.1111.111 is NaN.
double ref_decode(int code) {
  int e = (code >> 3) & 15, m = code & 7;
  double v = e == 0 ? std::ldexp(m, -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return (code & 0x80) ? -v : v;
}

// Nearest finite code by exhaustive search, ties to the even code, saturating at 448.
uint8_t ref_encode(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return sign | 0x7f;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 448.0) return sign | 0x7e;
  int best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7e; ++c) {
    double err = std::fabs(ref_decode(c) - a);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = c;
      best_err = err;
    }
  }
  return sign | static_cast<uint8_t>(best);
}

TEST(Fp8, DecodeEveryCode) {
  for (int c = 0; c < 256; ++c) {
    float v = fp8_e4m3fn_to_float(static_cast<uint8_t>(c));
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(v)) << c;
      continue;
    }
    EXPECT_EQ(v, static_cast<float>(ref_decode(c))) << c;
    EXPECT_EQ(fp8_e4m3fn_from_float(v), c) << c;  // round trip
  }
  EXPECT_EQ(fp8_e4m3fn_to_float(0x7e), 448.0f);
  EXPECT_EQ(fp8_e4m3fn_to_float(0x01), std::ldexp(1.0f, -9));
}

TEST(Fp8, EncodeEveryBf16Value) {
  for (uint32_t b = 0; b < 65536; ++b) {
    float x = bf16_to_float(static_cast<uint16_t>(b));
    ASSERT_EQ(fp8_e4m3fn_from_float(x), ref_encode(x)) << "bf16 bits " << b << " value " << x;
  }
}

TEST(Fp8, EncodeRandomFloatsAndTies) {
  std::mt19937 rng(5);
  for (int i = 0; i < 200000; ++i) {
    float x = std::bit_cast<float>(static_cast<uint32_t>(rng()));
    if (i % 2)
      x = std::ldexp(static_cast<float>(rng()) / 4294967296.0f, static_cast<int>(rng() % 30) - 20);  // fp8 range
    ASSERT_EQ(fp8_e4m3fn_from_float(x), ref_encode(x)) << x;
  }
  // Exact midpoints between neighbours go to the even code; one ulp either side does not tie.
  for (int c = 0; c < 0x7e; ++c) {
    float mid = static_cast<float>((ref_decode(c) + ref_decode(c + 1)) / 2);
    ASSERT_EQ(static_cast<double>(mid), (ref_decode(c) + ref_decode(c + 1)) / 2);
    EXPECT_EQ(fp8_e4m3fn_from_float(mid), (c & 1) ? c + 1 : c) << c;
    EXPECT_EQ(fp8_e4m3fn_from_float(-mid), 0x80 | ((c & 1) ? c + 1 : c)) << c;
    EXPECT_EQ(fp8_e4m3fn_from_float(std::nextafter(mid, 0.0f)), c) << c;
    EXPECT_EQ(fp8_e4m3fn_from_float(std::nextafter(mid, 1000.0f)), c + 1) << c;
  }
}

TEST(Fp8, SaturatesAndKeepsNan) {
  EXPECT_EQ(fp8_e4m3fn_from_float(448.0f), 0x7e);
  EXPECT_EQ(fp8_e4m3fn_from_float(464.0f), 0x7e);  // a tie with the NaN pattern's value 480
  EXPECT_EQ(fp8_e4m3fn_from_float(1e30f), 0x7e);
  EXPECT_EQ(fp8_e4m3fn_from_float(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(fp8_e4m3fn_from_float(std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_EQ(fp8_e4m3fn_from_float(-0.0f), 0x80);
  EXPECT_EQ(fp8_e4m3fn_from_float(std::ldexp(1.0f, -10)), 0x00);   // tie between 0 and 2^-9: even
  EXPECT_EQ(fp8_e4m3fn_from_float(std::ldexp(3.0f, -10)), 0x02);   // tie between 1 and 2 subnormal steps
  EXPECT_EQ(fp8_e4m3fn_from_float(std::ldexp(15.0f, -10)), 0x08);  // rounds up into the smallest normal
}

TEST(Bf16, Conversions) {
  EXPECT_EQ(bf16_to_float(0x3f80), 1.0f);
  EXPECT_EQ(bf16_to_float(0xc000), -2.0f);
  EXPECT_EQ(bf16_from_float(1.0f + std::ldexp(1.0f, -8)), 0x3f80);      // tie -> even
  EXPECT_EQ(bf16_from_float(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);  // tie -> even
  EXPECT_TRUE(std::isnan(bf16_to_float(bf16_from_float(std::numeric_limits<float>::quiet_NaN()))));
  for (uint32_t b = 0; b < 65536; ++b) {
    float x = bf16_to_float(static_cast<uint16_t>(b));
    if (!std::isnan(x)) ASSERT_EQ(bf16_from_float(x), b);
  }
}

// ---- tensor quantization vs a scalar reference ------------------------------------------------

struct RefResult {
  std::vector<uint8_t> q;
  std::vector<float> scales;
};

// DeepGEMM's per_block_cast_to_fp8, one group at a time, written plainly.
RefResult ref_quantize(const std::vector<float>& x, int64_t rows, int64_t cols, int64_t block) {
  RefResult out;
  out.q.resize(x.size());
  for (int64_t r0 = 0; r0 < rows; r0 += block)
    for (int64_t c0 = 0; c0 < cols; c0 += block) {
      float amax = 0;
      for (int64_t r = r0; r < std::min(rows, r0 + block); ++r)
        for (int64_t c = c0; c < std::min(cols, c0 + block); ++c) amax = std::max(amax, std::fabs(x[r * cols + c]));
      if (amax < 1e-4f) amax = 1e-4f;
      float inv = 448.0f / amax;
      for (int64_t r = r0; r < std::min(rows, r0 + block); ++r)
        for (int64_t c = c0; c < std::min(cols, c0 + block); ++c)
          out.q[r * cols + c] = ref_encode(x[r * cols + c] * inv);
      out.scales.push_back(amax / 448.0f);
    }
  return out;
}

std::vector<float> random_values(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> v(n);
  for (auto& x : v) x = normal(rng);
  for (size_t i = 0; i < n; i += 997) v[i] *= 50.0f;  // outliers
  return v;
}

TEST(Fp8Quantize, Bf16BlockAndPerTensorMatchTheReference) {
  const int64_t rows = 300, cols = 200;  // partial edge blocks both ways
  auto values = random_values(rows * cols, 1);
  // A zero block and a tiny block exercise the 1e-4 clamp.
  for (int64_t r = 128; r < 256; ++r)
    for (int64_t c = 0; c < 128; ++c) values[r * cols + c] = 0.0f;
  for (int64_t r = 256; r < 300; ++r)
    for (int64_t c = 128; c < 200; ++c) values[r * cols + c] *= 1e-4f;
  std::vector<uint16_t> bf16(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    bf16[i] = bf16_from_float(values[i]);
    values[i] = bf16_to_float(bf16[i]);
  }
  TensorInfo info{"model.layers.0.mlp.down_proj.weight", DType::kBFloat16, {rows, cols}};
  const auto* src = reinterpret_cast<const std::byte*>(bf16.data());

  Fp8Tensor block = quantize_fp8(src, info, Fp8Scaling::kBlock128);
  EXPECT_THAT(block.scale_shape, ElementsAre(3, 2));
  RefResult ref = ref_quantize(values, rows, cols, 128);
  ASSERT_EQ(block.data, ref.q);
  ASSERT_EQ(block.scales, ref.scales);
  EXPECT_EQ(block.scales[2], 1e-4f / 448.0f);  // the zero block
  for (int64_t c = 0; c < 128; ++c) EXPECT_EQ(block.data[128 * cols + c], 0);

  Fp8Tensor whole = quantize_fp8(src, info, Fp8Scaling::kPerTensor);
  EXPECT_THAT(whole.scale_shape, ElementsAre(1));
  ref = ref_quantize(values, 1, rows * cols, rows * cols);
  ASSERT_EQ(whole.data, ref.q);
  ASSERT_EQ(whole.scales, ref.scales);

  // Dequantized values stay within e4m3's precision of the input.
  for (size_t i = 0; i < values.size(); ++i) {
    float back = fp8_e4m3fn_to_float(whole.data[i]) * whole.scales[0];
    ASSERT_LE(std::fabs(back - values[i]), std::fabs(values[i]) / 16 + whole.scales[0] * std::ldexp(1.0f, -9)) << i;
  }
}

TEST(Fp8Quantize, Fp32MatchesTheReference) {
  const int64_t rows = 130, cols = 257;
  auto values = random_values(rows * cols, 2);
  TensorInfo info{"w", DType::kFloat32, {rows, cols}};
  const auto* src = reinterpret_cast<const std::byte*>(values.data());
  Fp8Tensor block = quantize_fp8(src, info, Fp8Scaling::kBlock128);
  EXPECT_THAT(block.scale_shape, ElementsAre(2, 3));
  RefResult ref = ref_quantize(values, rows, cols, 128);
  EXPECT_EQ(block.data, ref.q);
  EXPECT_EQ(block.scales, ref.scales);
  // Per-tensor works for any rank.
  TensorInfo flat{"w", DType::kFloat32, {rows * cols}};
  ref = ref_quantize(values, 1, rows * cols, rows * cols);
  Fp8Tensor whole = quantize_fp8(src, flat, Fp8Scaling::kPerTensor);
  EXPECT_EQ(whole.data, ref.q);
  EXPECT_EQ(whole.scales, ref.scales);
}

TEST(Fp8Quantize, Rejections) {
  std::vector<float> v = {1.0f, std::numeric_limits<float>::infinity(), 2.0f, 3.0f};
  const auto* src = reinterpret_cast<const std::byte*>(v.data());
  EXPECT_THAT(error_of(ErrorKind::kInvalidArgument,
                       [&] {
                         quantize_fp8(src, {"lm_head.weight", DType::kFloat32, {2, 2}}, Fp8Scaling::kPerTensor);
                       }),
              AllOf(HasSubstr("lm_head.weight"), HasSubstr("element 1 is inf")));
  v[1] = 0.0f;
  EXPECT_THAT(error_of(ErrorKind::kInvalidArgument,
                       [&] {
                         quantize_fp8(src, {"n.weight", DType::kFloat32, {1, 2, 2}}, Fp8Scaling::kBlock128);
                       }),
              AllOf(HasSubstr("n.weight"), HasSubstr("2-D")));
  EXPECT_THAT(error_of(ErrorKind::kInvalidArgument,
                       [&] {
                         quantize_fp8(src, {"i", DType::kInt32, {4}}, Fp8Scaling::kPerTensor);
                       }),
              AllOf(HasSubstr("'i'"), HasSubstr("int32")));
}

// ---- KV-cache scales ------------------------------------------------------------------------

TEST(KvScales, NamesOrderAndDefaults) {
  auto s = kv_scale_tensors(2, {{"model.layers.1.self_attn.k_scale", 0.5f}, {"not.a.scale", 3.0f}});
  std::vector<std::string> names;
  for (const auto& t : s.tensors) {
    names.push_back(t.name);
    EXPECT_EQ(t.dtype, DType::kFloat32);
    EXPECT_EQ(t.shape, (std::vector<int64_t>{1}));
    EXPECT_EQ(t.nbytes(), 4u);
  }
  EXPECT_THAT(names, ElementsAre("model.layers.0.self_attn.attn.q_scale", "model.layers.0.self_attn.k_scale",
                                 "model.layers.0.self_attn.v_scale", "model.layers.1.self_attn.attn.q_scale",
                                 "model.layers.1.self_attn.k_scale", "model.layers.1.self_attn.v_scale"));
  EXPECT_THAT(s.values, ElementsAre(1.0f, 1.0f, 1.0f, 1.0f, 0.5f, 1.0f));
  EXPECT_TRUE(kv_scale_tensors(0, {}).tensors.empty());
  error_of(ErrorKind::kInvalidArgument, [] { kv_scale_tensors(-1, {}); });
}

TEST(KvScales, AScaleThatIsNotAFiniteNumberAboveZeroIsRefusedByName) {
  for (float bad : {std::nanf(""), INFINITY, -INFINITY, -0.5f, 0.0f})
    EXPECT_THAT(error_of(ErrorKind::kInvalidArgument,
                         [&] {
                           kv_scale_tensors(2, {{"model.layers.1.self_attn.v_scale", bad},
                                                {"model.layers.0.self_attn.k_scale", 2.0f}});
                         }),
                AllOf(HasSubstr("'model.layers.1.self_attn.v_scale'"), HasSubstr("finite number above 0")))
        << bad;
  // A name of no layer is ignored, as the reference does (listed for a warning), whatever its value.
  const KvScales ignored =
      kv_scale_tensors(1, {{"model.layers.5.self_attn.k_scale", -1.0f}, {"model.layers.0.self_attn.v_scale", 0.5f}});
  EXPECT_EQ(ignored.values, (std::vector<float>{1, 1, 0.5f}));
  EXPECT_EQ(ignored.ignored, std::vector<std::string>{"model.layers.5.self_attn.k_scale"});
}

// ---- FP8 checkpoints: weights with their scales ----------------------------------------------

const TensorInfo& named(const ModelInventory& inv, std::string_view name) {
  for (const auto& t : inv.tensors)
    if (t.name == name) return t;
  throw std::runtime_error("no tensor " + std::string(name));
}

TEST(Fp8Checkpoint, LinearWeightsBecomeFp8FollowedByTheirBlockScales) {
  const ModelInventory bf16 = inventory_from_hf_config(kDefaultModel);
  const ModelInventory fp8 = fp8_block_inventory(bf16);
  uint64_t quantized = 0, scale_bytes = 0;
  for (size_t i = 0, j = 0; i < bf16.tensors.size(); ++i, ++j) {
    const TensorInfo& t = bf16.tensors[i];
    ASSERT_EQ(fp8.tensors[j].name, t.name);
    if (!is_fp8_linear_weight(t)) {
      EXPECT_EQ(fp8.tensors[j], t);
      continue;
    }
    ++quantized;
    EXPECT_EQ(fp8.tensors[j].dtype, DType::kFloat8E4M3FN) << t.name;
    EXPECT_EQ(fp8.tensors[j].shape, t.shape);
    const TensorInfo& scale = fp8.tensors[++j];
    EXPECT_EQ(scale.name, t.name + "_scale_inv");
    EXPECT_EQ(scale.dtype, DType::kFloat32);
    EXPECT_EQ(scale.shape, fp8_scale_shape(t, Fp8Scaling::kBlock128));
    scale_bytes += scale.nbytes();
  }
  EXPECT_GT(quantized, 400u);  // every expert, attention and dense projection
  EXPECT_EQ(named(fp8, "model.embed_tokens.weight").dtype, DType::kBFloat16);
  EXPECT_EQ(named(fp8, "lm_head.weight").dtype, DType::kBFloat16);
  EXPECT_EQ(named(fp8, "model.layers.0.mlp.gate.weight").dtype, DType::kBFloat16);  // the router
  EXPECT_EQ(fp8.tensors.size(), bf16.tensors.size() + quantized);
  EXPECT_EQ(named(fp8, "model.layers.3.mlp.experts.5.down_proj.weight_scale_inv").shape,
            (std::vector<int64_t>{8, 2}));  // [1024, 256] in 128-blocks
  EXPECT_GT(scale_bytes, 0u);
  EXPECT_NE(fp8.fingerprint(), bf16.fingerprint());
}

ModelInventory scaled_model() {
  ModelInventory m;
  m.name = "scales";
  m.tensors = {
      {"block.weight", DType::kFloat8E4M3FN, {300, 256}},
      {"block.weight_scale_inv", DType::kFloat32, {3, 2}},
      {"channel.weight", DType::kFloat8E4M3FN, {64, 32}},
      {"channel.weight_scale", DType::kFloat32, {64, 1}},
      {"row.weight", DType::kFloat8E5M2, {64, 32}},
      {"row.weight_scale", DType::kFloat32, {64}},
      {"tensor.weight", DType::kFloat8E4M3FN, {64, 32}},
      {"tensor.weight_scale", DType::kFloat32, {1}},
      {"odd.weight", DType::kFloat8E4M3FN, {300, 256}},
      {"odd.weight_scale_inv", DType::kFloat32, {5, 2}},
      {"bf16.weight", DType::kBFloat16, {64, 32}},
      {"bf16.weight_scale", DType::kFloat32, {64, 1}},  // not an FP8 weight's scale
      {"model.layers.0.self_attn.k_scale", DType::kFloat32, {1}},
  };
  return m;
}

TEST(Fp8Checkpoint, ScalesAreFoundByNameWithTheBlockTheirShapeGives) {
  const ModelInventory m = scaled_model();
  const auto links = fp8_scales_of(m);
  ASSERT_EQ(links.size(), 5u);
  auto link = [&](uint32_t scale, uint32_t weight, int64_t b0, int64_t b1) {
    return ::testing::AllOf(::testing::Field(&Fp8ScaleOf::scale, scale), ::testing::Field(&Fp8ScaleOf::weight, weight),
                            ::testing::Field(&Fp8ScaleOf::block, std::array<int64_t, 2>{b0, b1}));
  };
  EXPECT_THAT(links, ElementsAre(link(1, 0, 128, 128), link(3, 2, 1, 32), link(5, 4, 1, 32), link(7, 6, 64, 32),
                                 link(9, 8, 0, 128)));
}

TEST(Fp8Checkpoint, ASliceTakesTheScaleBlocksItCovers) {
  const ModelInventory m = scaled_model();
  const auto links = fp8_scales_of(m);
  const Fp8ScaleOf& block = links[0];
  auto scale_of = [&](const Fp8ScaleOf& l, Request w) { return fp8_scale_request(m, l, w, "destination rank 1"); };
  EXPECT_EQ(scale_of(block, Request::whole()), Request::whole());
  EXPECT_EQ(scale_of(block, Request::drop()), Request::drop());
  EXPECT_EQ(scale_of(block, Request::narrow(0, 128, 128)), Request::narrow(0, 1, 1));
  EXPECT_EQ(scale_of(block, Request::narrow(0, 256, 44)), Request::narrow(0, 2, 1));  // the last, partial block
  EXPECT_EQ(scale_of(block, Request::narrow(0, 0, 300)), Request::whole());
  EXPECT_EQ(scale_of(block, Request::narrow(1, 128, 128)), Request::narrow(1, 1, 1));
  // Per channel: rows go with their rows; a column slice keeps every row's scale.
  EXPECT_EQ(scale_of(links[1], Request::narrow(0, 16, 16)), Request::narrow(0, 16, 16));
  EXPECT_EQ(scale_of(links[1], Request::narrow(1, 0, 16)), Request::whole());
  EXPECT_EQ(scale_of(links[2], Request::narrow(0, 16, 16)), Request::narrow(0, 16, 16));
  // Per tensor: every holder needs the one scale.
  EXPECT_EQ(scale_of(links[3], Request::narrow(0, 16, 16)), Request::whole());
}

// A dim shorter than a block has one scale along it, which every element of that dim shares: a
// slice of it is not a cut through a block, and each holder takes the scale whole along it.
TEST(Fp8Checkpoint, ADimThatOneScaleBlockSpansIsNotSplitByItsScale) {
  ModelInventory m;
  m.tensors = {{"short.weight", DType::kFloat8E4M3FN, {100, 256}}, {"short.weight_scale_inv", DType::kFloat32, {1, 2}}};
  const auto links = fp8_scales_of(m);
  ASSERT_EQ(links.size(), 1u);
  EXPECT_EQ(links[0].block, (std::array<int64_t, 2>{100, 128}));
  EXPECT_EQ(fp8_scale_request(m, links[0], Request::narrow(0, 0, 50), "d"), Request::whole());
  EXPECT_EQ(fp8_scale_request(m, links[0], Request::narrow(0, 50, 50), "d"), Request::whole());
  EXPECT_EQ(fp8_scale_request(m, links[0], Request::narrow(1, 128, 128), "d"), Request::narrow(1, 1, 1));
  EXPECT_THAT(error_of(ErrorKind::kLayout, [&] { fp8_scale_request(m, links[0], Request::narrow(1, 0, 64), "d"); }),
              HasSubstr("scale block 0 (elements [0, 128))"));
}

TEST(Fp8Checkpoint, ASliceThroughAScaleBlockIsRefusedNamingTheBlock) {
  const ModelInventory m = scaled_model();
  const auto links = fp8_scales_of(m);
  EXPECT_THAT(error_of(ErrorKind::kLayout,
                       [&] { fp8_scale_request(m, links[0], Request::narrow(0, 150, 150), "destination rank 1"); }),
              AllOf(HasSubstr("destination rank 1"), HasSubstr("'block.weight' slice dim 0 [150, 300)"),
                    HasSubstr("scale block 1 (elements [128, 256)) of 'block.weight_scale_inv'"),
                    HasSubstr("multiples of 128")));
  EXPECT_THAT(
      error_of(ErrorKind::kLayout, [&] { fp8_scale_request(m, links[0], Request::narrow(1, 0, 64), "source rank 0"); }),
      AllOf(HasSubstr("source rank 0"), HasSubstr("scale block 0 (elements [0, 128))")));
  // A scale shape that none of the conventions explains: whole only.
  EXPECT_EQ(fp8_scale_request(m, links[4], Request::whole(), "x"), Request::whole());
  EXPECT_THAT(error_of(ErrorKind::kLayout, [&] { fp8_scale_request(m, links[4], Request::narrow(0, 0, 128), "x"); }),
              AllOf(HasSubstr("'odd.weight_scale_inv' of shape [5, 2]"), HasSubstr("is unknown")));
}

}  // namespace
}  // namespace refit
