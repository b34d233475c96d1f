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

}  // namespace
}  // namespace refit
