// TensorProgram: what a source sends (its tensors, in order), what a destination loads into by
// name and refuses (another dtype or shape, a name it does not hold), the checks of add(), the
// report, and real refits between forked processes through tensor_program().
#include "refit/tensor_program.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "core/error_of.h"
#include "refit/local_group.h"
#include "refit/synchronizer.h"

namespace refit {
namespace {

using testing::error_of;
using ::testing::HasSubstr;
using ::testing::Not;

// The views a source program streams for refit `index`.
std::vector<TensorView> sent(TensorProgram& program, uint64_t index = 0) {
  auto source = program.weights(index);
  std::vector<TensorView> out;
  TensorView v;
  while (source->next(&v)) out.push_back(v);
  return out;
}

TEST(TensorProgram, ASourceSendsEveryTensorInTheOrderAddedFromItsOwnMemory) {
  TensorProgram p;
  std::vector<int32_t> caller(6, 7);
  const auto w = p.add("w", std::vector<float>(4, 1.5f));
  p.add(TensorInfo{"b", DType::kInt32, {2, 3}}, caller.data(), MemoryKind::kHost);
  const auto e = p.add("e", std::vector<double>(6, 2.0), {3, 2});
  EXPECT_EQ(p.size(), 3u);
  EXPECT_EQ(p.bytes(), 4 * 4 + 6 * 4 + 6 * 8u);
  for (int refit = 0; refit < 2; ++refit) {  // every refit streams the same tensors again
    const auto views = sent(p, refit);
    ASSERT_EQ(views.size(), 3u);
    EXPECT_EQ(*views[0].info, (TensorInfo{"w", DType::kFloat32, {4}}));
    EXPECT_EQ(views[0].data, reinterpret_cast<const std::byte*>(w.data()));
    EXPECT_EQ(*views[1].info, (TensorInfo{"b", DType::kInt32, {2, 3}}));
    EXPECT_EQ(views[1].data, reinterpret_cast<const std::byte*>(caller.data()));  // not a copy
    EXPECT_EQ(*views[2].info, (TensorInfo{"e", DType::kFloat64, {3, 2}}));
    EXPECT_EQ(views[2].data, reinterpret_cast<const std::byte*>(e.data()));
    for (const auto& v : views) EXPECT_EQ(v.memory, MemoryKind::kHost);
  }
}

TEST(TensorProgram, ADestinationCopiesEachReceivedTensorIntoItsOwnByName) {
  TensorProgram source, destination;
  source.add("a", std::vector<float>{1, 2, 3});
  source.add("b", std::vector<int64_t>{4, 5});
  std::vector<int64_t> b(2, 0);  // the caller's memory
  destination.add(TensorInfo{"b", DType::kInt64, {2}}, b.data(), MemoryKind::kHost);
  const auto a = destination.add("a", std::vector<float>(3, 0.0f));
  destination.stage(0);
  const auto views = sent(source);
  destination.loader(0)(views);
  EXPECT_EQ(std::vector<float>(a.begin(), a.end()), (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(b, (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(destination.report(0), R"({"bytes":28,"tensors":2})");
}

TEST(TensorProgram, AReceivedTensorOfAnotherDtypeOrShapeOrNameIsRefusedNamingItBeforeAnyCopy) {
  TensorProgram destination;
  const auto w = destination.add("w", std::vector<float>(6, 0.0f), {2, 3});
  const auto ok = destination.add("ok", std::vector<float>(2, 0.0f));
  struct Case {
    TensorInfo info;
    std::string says;
  } cases[] = {
      {{"w", DType::kFloat32, {3, 2}},
       "received tensor 'w' is float32 [3, 2] but its parameter here is float32 [2, 3]"},
      {{"w", DType::kInt32, {2, 3}}, "received tensor 'w' is int32 [2, 3] but its parameter here is float32 [2, 3]"},
      {{"v", DType::kFloat32, {2, 3}}, "received tensor 'v' has no parameter here"},
  };
  const std::vector<float> bytes(6, 9.0f), two(2, 9.0f);
  const TensorInfo ok_info{"ok", DType::kFloat32, {2}};
  for (const auto& c : cases) {
    const TensorView batch[] = {{&ok_info, reinterpret_cast<const std::byte*>(two.data()), MemoryKind::kHost},
                                {&c.info, reinterpret_cast<const std::byte*>(bytes.data()), MemoryKind::kHost}};
    EXPECT_THAT(error_of(ErrorKind::kLayout, [&] { destination.loader(0)(batch); }), HasSubstr(c.says));
    EXPECT_EQ(ok[0], 0.0f) << c.says;  // nothing of the batch was copied
    EXPECT_EQ(w[0], 0.0f) << c.says;
  }
}

TEST(TensorProgram, AddRefusesADuplicateNameNoDataOrAShapeThatDoesNotHoldTheValuesNamingTheTensor) {
  TensorProgram p;
  p.add("w", std::vector<float>(4, 0.0f));
  EXPECT_THAT(error_of(ErrorKind::kInvalidArgument, [&] { p.add("w", std::vector<float>(4, 0.0f)); }),
              HasSubstr("'w' was added twice"));
  float other[4] = {};
  EXPECT_THAT(error_of(ErrorKind::kInvalidArgument,
                       [&] {
                         p.add(TensorInfo{"w", DType::kFloat32, {4}}, other, MemoryKind::kHost);
                       }),
              HasSubstr("'w' was added twice"));
  EXPECT_THAT(error_of(ErrorKind::kInvalidArgument,
                       [&] {
                         p.add(TensorInfo{"null", DType::kBFloat16, {8}}, nullptr, MemoryKind::kCuda);
                       }),
              HasSubstr("'null' of 16 bytes has no data pointer"));
  EXPECT_THAT(error_of(ErrorKind::kInvalidArgument,
                       [&] {
                         p.add("m", std::vector<int8_t>(6, 0), {4, 2});
                       }),
              HasSubstr("tensor 'm' of shape [4, 2] holds 8 elements, its values are 6"));
  EXPECT_THAT(error_of(ErrorKind::kInvalidArgument,
                       [&] {
                         p.add("n", std::vector<int8_t>(6, 0), {-2, -3});
                       }),
              HasSubstr("tensor 'n' has a negative dimension in its shape [-2, -3]"));
  EXPECT_THAT(error_of(ErrorKind::kInvalidArgument, [&] { p.add("", std::vector<int8_t>(6, 0)); }),
              HasSubstr("a tensor needs a name"));
  EXPECT_EQ(p.size(), 1u);                // what was refused is not held
  p.add("null", std::vector<uint8_t>{});  // an empty tensor has no bytes to point at
  EXPECT_EQ(p.size(), 2u);
}

TEST(TensorProgram, ATensorThatNoSourceSentFailsTheDestinationsReportNamingIt) {
  TensorProgram source, destination;
  source.add("a", std::vector<float>(2, 1.0f));
  destination.add("a", std::vector<float>(2, 0.0f));
  destination.add("stale", std::vector<float>(2, 0.0f));
  const auto views = sent(source);
  destination.stage(0);
  destination.loader(0)(views);
  const std::string message = error_of(ErrorKind::kLayout, [&] { destination.report(0); });
  EXPECT_THAT(message, HasSubstr("refit 0: no source sent 1 of the 2 tensors this destination holds ('stale')"));
  EXPECT_THAT(message, Not(HasSubstr("'a'")));
  // A refit of every tensor reports; so does a source, which loads nothing.
  destination.stage(1);
  destination.loader(1)(views);
  TensorProgram rest;
  rest.add("stale", std::vector<float>(2, 1.0f));
  destination.loader(1)(sent(rest));
  EXPECT_EQ(destination.report(1), R"({"bytes":16,"tensors":2})");
  EXPECT_EQ(source.report(0), R"({"bytes":8,"tensors":1})");
}

TEST(TensorProgram, AFailedRefitsLoadsDoNotCountForTheNext) {
  TensorProgram source, destination;
  source.add("a", std::vector<float>(2, 1.0f));
  destination.add("a", std::vector<float>(2, 0.0f));
  destination.add("b", std::vector<float>(2, 0.0f));
  destination.stage(0);
  destination.loader(0)(sent(source));  // then refit 0 fails: no report
  destination.stage(1);
  destination.loader(1)(std::span<const TensorView>());
  EXPECT_THAT(error_of(ErrorKind::kLayout, [&] { destination.report(1); }),
              HasSubstr("no source sent 2 of the 2 tensors this destination holds ('a', 'b')"));
}

TEST(TensorProgram, AMissingListNamesFiveTensorsAndCountsTheRest) {
  TensorProgram destination;
  for (int i = 0; i < 8; ++i) destination.add("t" + std::to_string(i), std::vector<uint8_t>(1, 0));
  destination.loader(0)(std::span<const TensorView>());
  EXPECT_THAT(error_of(ErrorKind::kLayout, [&] { destination.report(0); }),
              HasSubstr("('t0', 't1', 't2', 't3', 't4' and 3 more)"));
}

TEST(TensorProgram, SetReportReplacesTheDefault) {
  TensorProgram p;
  const auto w = p.add("w", std::vector<float>(3, 0.5f));
  p.set_report([w] { return std::to_string(w.back()); });
  EXPECT_EQ(p.report(0), "0.500000");
}

// The README's program with more tensors: one refit and a second one between forked processes,
// each side reporting what it holds.
TEST(TensorProgram, RefitsBetweenProcessesThroughTensorProgram) {
  GroupOptions group;
  group.config.bucket_bytes = 1 << 20;  // several buckets
  group.program = tensor_program([](bool is_source, int rank, TensorProgram& p) {
    std::vector<float> w(1 << 19);  // 2 MiB
    std::iota(w.begin(), w.end(), is_source ? 1.0f : 0.0f);
    const auto held = p.add("w", std::move(w), {1 << 9, 1 << 10});
    const auto b = p.add("b", std::vector<int64_t>(3, is_source ? 42 : 0));
    p.set_report([held, b] { return std::to_string(held[12345]) + " " + std::to_string(b[2]); });
  });
  LocalProcessGroup workers(group);
  WeightSynchronizer sync(group.config, workers);
  for (int refit = 0; refit < 2; ++refit) {
    const RefitReport report = sync.sync_weights();
    ASSERT_EQ(report.workers.size(), 2u);
    EXPECT_EQ(report.workers[1].receive.tensors, 2u);
    EXPECT_EQ(report.workers[1].receive.payload_bytes, (2u << 20) + 24);
    EXPECT_EQ(report.workers[0].detail, "12346.000000 42");
    EXPECT_EQ(report.workers[1].detail, "12346.000000 42");  // it started from 12345 and 0
  }
}

TEST(TensorProgram, ADestinationOfAnotherShapeFailsTheRefitNamingTheTensor) {
  GroupOptions group;
  group.program = tensor_program([](bool is_source, int, TensorProgram& p) {
    p.add("w", std::vector<float>(1024, 1.0f), is_source ? std::vector<int64_t>{32, 32} : std::vector<int64_t>{1024});
  });
  LocalProcessGroup workers(group);
  WeightSynchronizer sync(group.config, workers);
  sync.set_model_bytes(4096);
  const std::string message = error_of(ErrorKind::kLayout, [&] { sync.sync_weights(); });
  EXPECT_THAT(message, HasSubstr("received tensor 'w' is float32 [32, 32] but its parameter here is float32 [1024]"));
  EXPECT_TRUE(sync.stale());
}

TEST(TensorProgram, ADestinationHoldingATensorNoSourceSentFailsTheRefitNamingIt) {
  GroupOptions group;
  group.program = tensor_program([](bool is_source, int, TensorProgram& p) {
    p.add("w", std::vector<float>(1024, 1.0f));
    if (!is_source) p.add("lm_head.weight", std::vector<float>(16, 0.0f));
  });
  LocalProcessGroup workers(group);
  WeightSynchronizer sync(group.config, workers);
  sync.set_model_bytes(4096);
  const std::string message = error_of(ErrorKind::kLayout, [&] { sync.sync_weights(); });
  EXPECT_THAT(message, HasSubstr("no source sent 1 of the 2 tensors this destination holds ('lm_head.weight')"));
  EXPECT_TRUE(sync.stale());
}

TEST(TensorProgram, TensorProgramWithoutASetupIsRefused) {
  EXPECT_THAT(error_of(ErrorKind::kInvalidArgument, [] { tensor_program(nullptr); }), HasSubstr("no setup function"));
}

}  // namespace
}  // namespace refit
