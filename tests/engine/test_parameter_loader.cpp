// ParameterLoader: received tensors copied by name into memory the destination registered.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/error_of.h"
#include "engine_harness.h"
#include "refit/parameter_loader.h"

namespace refit {
namespace {

using ::testing::HasSubstr;
using testing::make_tensor;
using testing::OwnedTensor;
using testing::Pair;

std::vector<OwnedTensor> weights(uint32_t seed) {
  std::vector<OwnedTensor> out;
  for (int i = 0; i < 40; ++i)
    out.push_back(make_tensor("p" + std::to_string(i), DType::kBFloat16, {i + 1, 3}, seed + i));
  out.push_back(make_tensor("empty", DType::kFloat32, {0}, seed));
  out.push_back(make_tensor("big", DType::kFloat32, {100}, seed));  // split over 64-byte buckets, merged
  return out;
}

TEST(ParameterLoader, LoadsEveryTensorIntoItsParameterOverRefits) {
  Pair p(64);
  p.connect();
  const auto first = weights(1);
  std::vector<std::vector<std::byte>> params;
  ParameterLoader loader;
  for (const auto& t : first) {
    params.emplace_back(t.data.size());
    loader.add(t.info, params.back().data(), MemoryKind::kHost);
  }
  EXPECT_EQ(loader.size(), first.size());
  for (uint32_t refit = 0; refit < 3; ++refit) {
    const auto w = weights(10 * refit);
    auto sent = p.start_send(w);
    p.destination->receive(loader.loader());
    sent.get();
    for (size_t i = 0; i < w.size(); ++i) EXPECT_EQ(params[i], w[i].data) << w[i].info.name << ", refit " << refit;
  }
  EXPECT_EQ(loader.tensors_loaded(), 3 * first.size());
  EXPECT_TRUE(loader.take_not_loaded().empty());
}

TEST(ParameterLoader, SaysWhichParametersNoSourceSent) {
  Pair p(64);
  p.connect();
  auto w = weights(1);
  std::vector<std::vector<std::byte>> params;
  ParameterLoader loader;
  for (const auto& t : w) {
    params.emplace_back(t.data.size());
    loader.add(t.info, params.back().data(), MemoryKind::kHost);
  }
  std::vector<OwnedTensor> some(w.begin(), w.begin() + 5);
  auto sent = p.start_send(some);
  p.destination->receive(loader.loader());
  sent.get();
  const auto missing = loader.take_not_loaded();
  ASSERT_EQ(missing.size(), w.size() - 5);
  EXPECT_EQ(missing.front(), "p5");
  EXPECT_EQ(missing.back(), "big");
  EXPECT_EQ(loader.take_not_loaded().size(), w.size());  // counted anew: nothing loaded since
}

TEST(ParameterLoader, ATensorWithoutAParameterOrOfAnotherDtypeOrShapeFailsTheRefitNamingIt) {
  const auto w = weights(1);
  enum Wrong { kNoParameter, kShape, kDtype };
  for (Wrong wrong : {kNoParameter, kShape, kDtype}) {
    Pair p(64);
    p.connect();
    std::vector<std::vector<std::byte>> params;
    ParameterLoader loader;
    for (const auto& t : w) {
      TensorInfo parameter = t.info;
      if (t.info.name == "p7") {
        if (wrong == kNoParameter) continue;
        // The same byte count either way: a loader that compared sizes only would take it.
        if (wrong == kShape) parameter.shape = {3, 8};
        if (wrong == kDtype) parameter.dtype = DType::kFloat16;
      }
      params.emplace_back(parameter.nbytes());
      loader.add(parameter, params.back().data(), MemoryKind::kHost);
    }
    auto sent = p.start_send(w);
    const std::string message = testing::error_of(ErrorKind::kLayout, [&] { p.destination->receive(loader.loader()); });
    const char* expected[] = {"received tensor 'p7' has no parameter here",
                              "received tensor 'p7' is bfloat16 [8, 3] but its parameter here is bfloat16 [3, 8]",
                              "received tensor 'p7' is bfloat16 [8, 3] but its parameter here is float16 [8, 3]"};
    EXPECT_THAT(message, HasSubstr(expected[wrong]));
    EXPECT_ANY_THROW(sent.get());  // the source is told
    EXPECT_TRUE(p.destination->stale());
  }
}

TEST(ParameterLoader, RefusesANameTwiceAndMemoryWithoutAPointer) {
  ParameterLoader loader;
  std::vector<std::byte> a(8);
  const TensorInfo a_info{"a", DType::kUInt8, {8}}, b_info{"b", DType::kUInt8, {8}};
  loader.add(a_info, a.data(), MemoryKind::kHost);
  EXPECT_THAT(testing::error_of(ErrorKind::kInvalidArgument, [&] { loader.add(a_info, a.data(), MemoryKind::kHost); }),
              HasSubstr("parameter 'a' was added twice"));
  EXPECT_THAT(testing::error_of(ErrorKind::kInvalidArgument, [&] { loader.add(b_info, nullptr, MemoryKind::kHost); }),
              HasSubstr("parameter 'b' of 8 bytes has no data pointer"));
  EXPECT_THAT(testing::error_of(ErrorKind::kInvalidArgument, [] { ParameterLoader bad(Device{}, 0); }),
              HasSubstr("timeout_s must be > 0"));
}

// Parameters share memory only as one tensor under two names (a tied weight); any other overlap
// would leave one holding the other's bytes after a refit, and is refused when it is added.
TEST(ParameterLoader, RefusesParametersThatShareMemoryWithoutBeingOneTensor) {
  std::vector<std::byte> memory(64);
  ParameterLoader loader;
  loader.add({"embed", DType::kBFloat16, {4, 4}}, memory.data(), MemoryKind::kHost);    // bytes [0, 32)
  loader.add({"lm_head", DType::kBFloat16, {4, 4}}, memory.data(), MemoryKind::kHost);  // tied
  const struct {
    TensorInfo info;
    size_t offset;
  } conflicts[] = {
      {{"half_over", DType::kBFloat16, {4, 4}}, 16},  // [16, 48)
      {{"inside", DType::kUInt8, {4}}, 8},            // [8, 12)
      {{"reinterpreted", DType::kFloat32, {8}}, 0},   // the same bytes as another dtype
      {{"reshaped", DType::kBFloat16, {16}}, 0},      // ... or shape
      {{"before", DType::kUInt8, {40}}, 0},
  };
  for (const auto& c : conflicts)
    EXPECT_THAT(testing::error_of(ErrorKind::kInvalidArgument,
                                  [&] { loader.add(c.info, memory.data() + c.offset, MemoryKind::kHost); }),
                HasSubstr("parameter '" + c.info.name + "'"))
        << c.info.name;
  EXPECT_EQ(loader.size(), 2u) << "a refused parameter is not added";
  loader.add({"after", DType::kUInt8, {32}}, memory.data() + 32, MemoryKind::kHost);  // adjacent: its own
  loader.add({"empty", DType::kUInt8, {0}}, memory.data() + 8, MemoryKind::kHost);    // no bytes: no overlap
  EXPECT_EQ(loader.size(), 4u);
}

// A tied weight loads when its names bring the same bytes; a source whose model does not tie them
// (different bytes under the two names) fails the refit naming both, in one batch or across
// batches, refit after refit, and nothing of that batch is copied.
TEST(ParameterLoader, ATiedWeightTakesOnlyTheSameBytesUnderBothNames) {
  for (const uint64_t bucket : {uint64_t{1} << 20, uint64_t{64}}) {  // one batch; a batch per tensor
    SCOPED_TRACE(bucket);
    Pair p(bucket);
    p.connect();
    std::vector<std::byte> tied(32), other(8);
    ParameterLoader loader;
    loader.add({"embed", DType::kBFloat16, {4, 4}}, tied.data(), MemoryKind::kHost);
    loader.add({"norm", DType::kUInt8, {8}}, other.data(), MemoryKind::kHost);
    loader.add({"lm_head", DType::kBFloat16, {4, 4}}, tied.data(), MemoryKind::kHost);
    for (uint32_t refit = 0; refit < 3; ++refit) {
      const OwnedTensor embed = make_tensor("embed", DType::kBFloat16, {4, 4}, 100 + refit);
      OwnedTensor head = embed;
      head.info.name = "lm_head";
      const OwnedTensor norm = make_tensor("norm", DType::kUInt8, {8}, 200 + refit);
      const std::vector<OwnedTensor> w{embed, norm, head};
      auto sent = p.start_send(w);
      p.destination->receive(loader.loader());
      sent.get();
      EXPECT_EQ(tied, embed.data);
      EXPECT_EQ(other, norm.data);
    }
    for (uint32_t refit = 0; refit < 2; ++refit) {
      const OwnedTensor embed = make_tensor("embed", DType::kBFloat16, {4, 4}, 300 + refit);
      const OwnedTensor head = make_tensor("lm_head", DType::kBFloat16, {4, 4}, 400 + refit);  // untied
      const OwnedTensor norm = make_tensor("norm", DType::kUInt8, {8}, 500 + refit);
      const std::vector<std::byte> before = tied;
      const std::vector<OwnedTensor> w{embed, norm, head};
      auto sent = p.start_send(w);
      const std::string error = testing::error_of(ErrorKind::kLayout, [&] { p.destination->receive(loader.loader()); });
      EXPECT_THAT(error, HasSubstr("received tensors 'embed' and 'lm_head' differ")) << "refit " << refit;
      EXPECT_THROW(sent.get(), Error);
      EXPECT_TRUE(tied == embed.data || tied == before) << "never the head's bytes";
      EXPECT_NE(tied, head.data);
      p.connect();
    }
  }
}

}  // namespace
}  // namespace refit
