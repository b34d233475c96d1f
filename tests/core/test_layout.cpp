#include "refit/layout.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "core/error_of.h"
#include "refit/error.h"

namespace refit {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

TensorInfo t(std::string name, DType dtype, std::vector<int64_t> shape) {
  return {std::move(name), dtype, std::move(shape)};
}

// Runs `f`, expects Error of `kind`, returns its message.
using testing::error_of;

ModelInventory small_model() {
  ModelInventory inv;
  inv.name = "small";
  inv.tensors = {t("model.embed_tokens.weight", DType::kBFloat16, {100, 8}),
                 t("model.layers.0.self_attn.q_proj.weight", DType::kBFloat16, {8, 8}),
                 t("model.layers.0.input_layernorm.weight", DType::kBFloat16, {8}),
                 t("model.layers.1.mlp.down_proj.weight", DType::kBFloat16, {8, 16}),
                 t("model.layers.10.mlp.down_proj.weight", DType::kBFloat16, {8, 16}),
                 t("lm_head.weight", DType::kFloat32, {100, 8})};
  return inv;
}

Layout sample_layout() {
  Layout l;
  l.tensors["model.embed_tokens.weight"] = Request::narrow(0, 50, 50);
  l.tensors["model.layers.0.self_attn.q_proj.weight"] = Request::narrow(1, 0, 4);
  l.tensors["lm_head.weight"] = Request::drop();
  l.tensors["model.layers.0.input_layernorm.weight"] = Request::whole();
  l.drop_prefixes = {"model.layers.1."};
  return l;
}

TEST(Layout, SelectAppliesEntryThenPrefixThenFallback) {
  Layout l = sample_layout();
  auto inv = small_model();
  Selection s = select(l, inv.tensors[0]);
  EXPECT_EQ(s.take, Take::kSlice);
  EXPECT_EQ(s.slice, (Slice{0, 50, 50}));
  EXPECT_EQ(s.info, t("model.embed_tokens.weight", DType::kBFloat16, {50, 8}));

  s = select(l, inv.tensors[1]);
  EXPECT_EQ(s.info.shape, (std::vector<int64_t>{8, 4}));
  EXPECT_EQ(select(l, inv.tensors[2]).take, Take::kWhole);
  EXPECT_EQ(select(l, inv.tensors[3]).take, Take::kDrop);                                                // prefix
  EXPECT_EQ(select(l, inv.tensors[5]).take, Take::kDrop);                                                // entry
  EXPECT_EQ(select(l, t("model.layers.0.self_attn.k_scale", DType::kFloat32, {1})).take, Take::kWhole);  // fallback
  l.fallback = Take::kDrop;
  EXPECT_EQ(select(l, t("model.layers.0.self_attn.k_scale", DType::kFloat32, {1})).take, Take::kDrop);
}

TEST(Layout, PrefixLayers1DoesNotDropLayers10) {
  Layout l;
  l.drop_prefixes = {"model.layers.1."};
  auto inv = small_model();
  EXPECT_EQ(select(l, inv.tensors[3]).take, Take::kDrop);   // model.layers.1.mlp...
  EXPECT_EQ(select(l, inv.tensors[4]).take, Take::kWhole);  // model.layers.10.mlp...
  validate_layout(l, inv, "destination rank 0");
}

TEST(Layout, SliceCoveringItsDimensionIsWhole) {
  Layout l;
  l.tensors["a"] = Request::narrow(1, 0, 16);
  Selection s = select(l, t("a", DType::kFloat32, {4, 16}));
  EXPECT_EQ(s.take, Take::kWhole);
  EXPECT_EQ(s.info.shape, (std::vector<int64_t>{4, 16}));
}

TEST(Layout, ZeroLengthSliceSendsAZeroByteTensor) {
  Layout l;
  l.tensors["a"] = Request::narrow(0, 4, 0);
  Selection s = select(l, t("a", DType::kFloat32, {4, 16}));
  EXPECT_EQ(s.take, Take::kSlice);
  EXPECT_EQ(s.info.nbytes(), 0u);
}

TEST(Layout, SelectRejectsASliceThatDoesNotFit) {
  Layout l;
  l.tensors["a"] = Request::narrow(2, 0, 1);
  auto msg = error_of(ErrorKind::kLayout, [&] { select(l, t("a", DType::kFloat32, {4, 16})); });
  EXPECT_THAT(msg, AllOf(HasSubstr("'a'"), HasSubstr("dim 2")));
  l.tensors["a"] = Request::narrow(0, 3, 2);
  msg = error_of(ErrorKind::kLayout, [&] { select(l, t("a", DType::kFloat32, {4, 16})); });
  EXPECT_THAT(msg, HasSubstr("outside its size 4"));
}

TEST(Layout, ValidateAcceptsAGoodLayout) {
  validate_layout(sample_layout(), small_model(), "destination rank 3");
  auto sum = layout_bytes(sample_layout(), small_model());
  EXPECT_EQ(sum.tensors, 4u);  // embed (slice), q_proj (slice), layernorm, layers.10 down
  EXPECT_EQ(sum.sliced, 2u);
  EXPECT_EQ(sum.dropped, 2u);
  EXPECT_EQ(sum.bytes, 50u * 8 * 2 + 8 * 4 * 2 + 8 * 2 + 8 * 16 * 2);
}

TEST(Layout, ValidateRejectionsNameTensorAndRank) {
  auto inv = small_model();
  Layout l;
  l.tensors["model.layers.99.foo.weight"] = Request::whole();
  EXPECT_THAT(
      error_of(ErrorKind::kLayout, [&] { validate_layout(l, inv, "destination rank 3"); }),
      AllOf(HasSubstr("model.layers.99.foo.weight"), HasSubstr("destination rank 3"), HasSubstr("does not have")));

  l = {};
  l.tensors["lm_head.weight"] = Request::narrow(2, 0, 1);
  EXPECT_THAT(error_of(ErrorKind::kLayout, [&] { validate_layout(l, inv, "destination rank 3"); }),
              AllOf(HasSubstr("lm_head.weight"), HasSubstr("destination rank 3"), HasSubstr("dim 2 is out of range")));

  l.tensors["lm_head.weight"] = Request::narrow(0, 90, 11);
  EXPECT_THAT(error_of(ErrorKind::kLayout, [&] { validate_layout(l, inv, "destination rank 3"); }),
              AllOf(HasSubstr("lm_head.weight"), HasSubstr("outside its size 100")));

  l = {};
  l.drop_prefixes = {"model.layers.1"};
  EXPECT_THAT(error_of(ErrorKind::kLayout, [&] { validate_layout(l, inv, "destination rank 3"); }),
              AllOf(HasSubstr("'model.layers.1'"), HasSubstr("end with '.'"), HasSubstr("destination rank 3")));
  l.drop_prefixes = {""};
  error_of(ErrorKind::kLayout, [&] { validate_layout(l, inv, "destination rank 3"); });

  l = {};
  l.drop_prefixes = {"model.layers.1."};
  l.tensors["model.layers.1.mlp.down_proj.weight"] = Request::narrow(1, 0, 8);
  EXPECT_THAT(error_of(ErrorKind::kLayout, [&] { validate_layout(l, inv, "destination rank 3"); }),
              AllOf(HasSubstr("model.layers.1.mlp.down_proj.weight"), HasSubstr("also drops its prefix")));

  l = {};
  l.fallback = Take::kSlice;
  error_of(ErrorKind::kLayout, [&] { validate_layout(l, inv, "destination rank 3"); });
}

// ---- encoding -------------------------------------------------------------------------------

TEST(LayoutCodec, RoundTrips) {
  Layout l = sample_layout();
  l.fallback = Take::kDrop;
  EXPECT_EQ(decode_layout(encode_layout(l)), l);
  EXPECT_EQ(decode_layout(encode_layout(Layout{})), Layout{});
}

TEST(LayoutCodec, RandomLayoutsRoundTrip) {
  std::mt19937_64 rng(7);
  for (int iter = 0; iter < 50; ++iter) {
    Layout l;
    l.fallback = rng() % 2 ? Take::kWhole : Take::kDrop;
    for (int i = 0, n = rng() % 5; i < n; ++i) l.drop_prefixes.push_back(fmt::format("p{}.", rng() % 1000));
    for (int i = 0, n = rng() % 40; i < n; ++i) {
      auto kind = rng() % 3;
      Request r = kind == 0   ? Request::whole()
                  : kind == 1 ? Request::drop()
                              : Request::narrow(rng() % 4, rng() % 1000, rng() % 1000);
      l.tensors[fmt::format("model.layers.{}.t{}", rng() % 64, i)] = r;
    }
    ASSERT_EQ(decode_layout(encode_layout(l)), l);
  }
}

TEST(LayoutCodec, EveryTruncationIsRejected) {
  auto bytes = encode_layout(sample_layout());
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto msg = error_of(ErrorKind::kProtocol, [&] {
      decode_layout(std::span<const uint8_t>(bytes.data(), n), "layout from destination rank 5");
    });
    EXPECT_THAT(msg, HasSubstr("layout from destination rank 5")) << n;
  }
  bytes.push_back(0);
  EXPECT_THAT(error_of(ErrorKind::kProtocol, [&] { decode_layout(bytes); }), HasSubstr("trailing"));
}

// Byte offsets in an encoding of a layout with no prefixes and one slice entry named "ab".
struct Offsets {
  static constexpr size_t kMagic = 0, kVersion = 4, kFallback = 6, kPrefixCount = 7, kEntryCount = 15, kNameLen = 23,
                          kName = 31, kTake = 33, kDim = 34, kStart = 38, kLength = 46;
};

std::vector<uint8_t> one_entry() {
  Layout l;
  l.tensors["ab"] = Request::narrow(1, 2, 3);
  return encode_layout(l);
}

template <typename T>
void poke(std::vector<uint8_t>& b, size_t at, T v) {
  std::memcpy(b.data() + at, &v, sizeof v);
}

TEST(LayoutCodec, MalformedFieldsAreNamed) {
  auto base = one_entry();
  ASSERT_EQ(base.size(), Offsets::kLength + 8);
  ASSERT_EQ(decode_layout(base).tensors.at("ab"), Request::narrow(1, 2, 3));
  struct Case {
    size_t at;
    int64_t value;
    size_t width;
    const char* field;
  };
  const Case cases[] = {
      {Offsets::kMagic, 0x12345678, 4, "magic"},
      {Offsets::kVersion, 9, 2, "version"},
      {Offsets::kFallback, 1, 1, "fallback"},  // slice is not a fallback
      {Offsets::kFallback, 7, 1, "fallback"},
      {Offsets::kPrefixCount, int64_t{1} << 40, 8, "drop_prefixes"},
      {Offsets::kEntryCount, int64_t{1} << 40, 8, "tensors"},
      {Offsets::kEntryCount, 2, 8, "tensor.name"},  // truncated second entry
      {Offsets::kNameLen, int64_t{1} << 50, 8, "tensor.name"},
      {Offsets::kNameLen, 0, 8, "tensor.name"},
      {Offsets::kTake, 3, 1, "tensor.take"},
      {Offsets::kDim, -1, 4, "tensor.slice.dim"},
      {Offsets::kDim, 64, 4, "tensor.slice.dim"},
      {Offsets::kStart, -5, 8, "tensor.slice"},
      {Offsets::kLength, -1, 8, "tensor.slice"},
      {Offsets::kLength, INT64_MAX, 8, "tensor.slice"},
  };
  for (const auto& c : cases) {
    auto b = base;
    if (c.width == 1) poke<uint8_t>(b, c.at, static_cast<uint8_t>(c.value));
    if (c.width == 2) poke<uint16_t>(b, c.at, static_cast<uint16_t>(c.value));
    if (c.width == 4) poke<int32_t>(b, c.at, static_cast<int32_t>(c.value));
    if (c.width == 8) poke<int64_t>(b, c.at, c.value);
    EXPECT_THAT(error_of(ErrorKind::kProtocol, [&] { decode_layout(b); }), HasSubstr(c.field))
        << c.field << " at " << c.at;
  }
}

TEST(LayoutCodec, DuplicateNamesAreRejected) {
  Layout l;
  l.tensors["ab"] = Request::drop();
  l.tensors["ac"] = Request::drop();
  auto b = encode_layout(l);
  // Second name "ac" -> "ab": entries are (len 8, 2 bytes, take 1) = 11 bytes each.
  b[Offsets::kName + 11 + 1] = 'b';
  EXPECT_THAT(error_of(ErrorKind::kProtocol, [&] { decode_layout(b); }), AllOf(HasSubstr("'ab'"), HasSubstr("twice")));
}

TEST(LayoutCodec, MutatedInputIsRejectedOrDecoded) {
  auto base = encode_layout(sample_layout());
  std::mt19937_64 rng(11);
  for (int iter = 0; iter < 20000; ++iter) {
    auto b = base;
    for (int k = 0, n = 1 + rng() % 4; k < n; ++k) b[rng() % b.size()] = static_cast<uint8_t>(rng());
    if (rng() % 4 == 0) b.resize(rng() % b.size());
    try {
      Layout l = decode_layout(b);
      EXPECT_EQ(decode_layout(encode_layout(l)), l);
    } catch (const Error& e) {
      ASSERT_EQ(e.kind(), ErrorKind::kProtocol) << e.what();
    }
  }
}

// ---- copy_slice -----------------------------------------------------------------------------

// Element-by-element reference: walk every index of the result and read the source.
std::vector<std::byte> naive_slice(const std::vector<std::byte>& src, const TensorInfo& info, const Slice& s) {
  const size_t es = dtype_size(info.dtype);
  std::vector<int64_t> out_shape = info.shape;
  out_shape[s.dim] = s.length;
  TensorInfo out_info{info.name, info.dtype, out_shape};
  std::vector<std::byte> out(out_info.nbytes());
  std::vector<int64_t> idx(out_shape.size(), 0);
  for (uint64_t e = 0; e < out_info.numel(); ++e) {
    uint64_t rem = e;
    for (size_t d = out_shape.size(); d-- > 0;) {
      idx[d] = static_cast<int64_t>(rem % out_shape[d]);
      rem /= out_shape[d];
    }
    uint64_t src_index = 0;
    for (size_t d = 0; d < idx.size(); ++d)
      src_index = src_index * info.shape[d] + (static_cast<int32_t>(d) == s.dim ? idx[d] + s.start : idx[d]);
    std::memcpy(out.data() + e * es, src.data() + src_index * es, es);
  }
  return out;
}

TEST(CopySlice, MatchesANaiveReferenceOnRandomShapes) {
  std::mt19937_64 rng(3);
  const DType dtypes[] = {DType::kUInt8, DType::kBFloat16, DType::kFloat32, DType::kFloat64};
  for (int iter = 0; iter < 500; ++iter) {
    TensorInfo info{"x", dtypes[rng() % 4], {}};
    for (int d = 0, n = 1 + rng() % 4; d < n; ++d) info.shape.push_back(1 + rng() % 7);
    std::vector<std::byte> src(info.nbytes());
    for (auto& b : src) b = static_cast<std::byte>(rng());
    Slice s;
    s.dim = static_cast<int32_t>(rng() % info.shape.size());
    s.start = static_cast<int64_t>(rng() % (info.shape[s.dim] + 1));
    s.length = static_cast<int64_t>(rng() % (info.shape[s.dim] - s.start + 1));
    auto expected = naive_slice(src, info, s);
    std::vector<std::byte> dst(expected.size() + 1, std::byte{0xAB});  // guard byte
    copy_slice(src.data(), info, s, dst.data());
    ASSERT_TRUE(expected.empty() || std::memcmp(dst.data(), expected.data(), expected.size()) == 0)
        << shape_string(info.shape) << " dim " << s.dim << " start " << s.start << " len " << s.length;
    ASSERT_EQ(dst.back(), std::byte{0xAB});
  }
}

TEST(CopySlice, CommonCases) {
  TensorInfo info{"w", DType::kInt32, {4, 6}};
  std::vector<int32_t> src(24);
  for (int i = 0; i < 24; ++i) src[i] = i;
  std::vector<int32_t> dst(12);
  copy_slice(reinterpret_cast<const std::byte*>(src.data()), info, {0, 2, 2}, reinterpret_cast<std::byte*>(dst.data()));
  EXPECT_EQ(dst, (std::vector<int32_t>{12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23}));
  copy_slice(reinterpret_cast<const std::byte*>(src.data()), info, {1, 3, 3}, reinterpret_cast<std::byte*>(dst.data()));
  EXPECT_EQ(dst, (std::vector<int32_t>{3, 4, 5, 9, 10, 11, 15, 16, 17, 21, 22, 23}));
  EXPECT_THAT(error_of(ErrorKind::kLayout,
                       [&] {
                         copy_slice(reinterpret_cast<const std::byte*>(src.data()), info, {1, 4, 3},
                                    reinterpret_cast<std::byte*>(dst.data()));
                       }),
              AllOf(HasSubstr("'w'"), HasSubstr("outside")));
}

}  // namespace
}  // namespace refit
