#include "refit/bucket_size.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "refit/error.h"

namespace refit {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;

RefitConfig with_ratio(double ratio) {
  RefitConfig c;
  c.update_weights_bucket_memory_ratio = ratio;
  return c;
}

Error sizing_error(const RefitConfig& config, std::vector<uint64_t> memory) {
  try {
    resolve_bucket_size(config, memory);
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "no refit::Error";
  return Error(ErrorKind::kInternal, "");
}

TEST(BucketSize, ReferenceExample80GiB) {
  std::vector<uint64_t> memory = {80 * kGiB};
  BucketSize size = resolve_bucket_size(with_ratio(0.05), memory);
  EXPECT_EQ(size.bytes, 4096 * kMiB);
  EXPECT_EQ(size.min_total_memory, 80 * kGiB);
  EXPECT_DOUBLE_EQ(size.ratio, 0.05);
  EXPECT_EQ(bucket_size_line(size, Device{Device::Kind::kCuda, -1}),
            "[checkpoint engine] Bucket size: 4096 MiB per buffer (5.0% of 80.00 GiB minimum total GPU memory).");
  EXPECT_EQ(bucket_size_line(size, Device{}),
            "[checkpoint engine] Bucket size: 4096 MiB per buffer (5.0% of 80.00 GiB minimum total host memory).");
}

TEST(BucketSize, APluginsRatioMayReachOne) {
  // A plugin keeps its own buffers: the reference bounds its ratio by 1, not by two buffers' 0.5.
  RefitConfig config = with_ratio(0.7);
  config.refit_transport = "my.engines:Loopback";
  std::vector<uint64_t> memory = {10 * kGiB};
  EXPECT_EQ(resolve_bucket_size(config, memory).bytes, 7168 * kMiB);
  EXPECT_THROW(resolve_bucket_size(with_ratio(0.7), memory), Error);  // nixl: two buffers must fit
}

TEST(BucketSize, NoLargerThanTheModelNeeds) {
  std::vector<uint64_t> memory = {80 * kGiB};
  // 366.5 MiB of model: buckets of 367 MiB, not 4096 MiB that would never fill.
  const uint64_t model = 366 * kMiB + kMiB / 2;
  BucketSize size = resolve_bucket_size(with_ratio(0.05), memory, model);
  EXPECT_EQ(size.bytes, 367 * kMiB);
  EXPECT_EQ(size.uncapped_bytes, 4096 * kMiB);
  EXPECT_EQ(bucket_size_line(size, Device{Device::Kind::kCuda, -1}),
            "[checkpoint engine] Bucket size: 367 MiB per buffer (the model's size; 5.0% of 80.00 GiB minimum total "
            "GPU memory would be 4096 MiB).");
  // A model larger than the ratio's bucket changes nothing; nor does it cap an explicit size.
  EXPECT_EQ(resolve_bucket_size(with_ratio(0.05), memory, 100 * kGiB), resolve_bucket_size(with_ratio(0.05), memory));
  RefitConfig fixed;
  fixed.bucket_bytes = 1 * kGiB;
  EXPECT_EQ(resolve_bucket_size(fixed, memory, model).bytes, 1 * kGiB);
}

TEST(BucketSize, MinimumOverWorkers) {
  // An H100 80 GB reports 85520809984 bytes; an H200 150754820096.
  std::vector<uint64_t> memory = {150754820096, 85520809984, 150754820096};
  BucketSize size = resolve_bucket_size(with_ratio(0.05), memory);
  EXPECT_EQ(size.min_total_memory, 85520809984u);
  EXPECT_EQ(size.bytes, 4077 * kMiB);  // int(85520809984 * 0.05) = 4276040499 -> 4077 MiB
  EXPECT_EQ(bucket_size_line(size, Device{Device::Kind::kCuda, 0}),
            "[checkpoint engine] Bucket size: 4077 MiB per buffer (5.0% of 79.65 GiB minimum total GPU memory).");
}

TEST(BucketSize, FloorsToWholeMiB) {
  std::vector<uint64_t> memory = {10 * kMiB + 12345};
  BucketSize size = resolve_bucket_size(with_ratio(0.3), memory);  // 3149431 bytes
  EXPECT_EQ(size.bytes, 3 * kMiB);
  std::vector<uint64_t> exact = {4 * kMiB};
  EXPECT_EQ(resolve_bucket_size(with_ratio(0.25), exact).bytes, kMiB);  // exactly 1 MiB is allowed
  EXPECT_EQ(bucket_size_line(resolve_bucket_size(with_ratio(0.125), std::vector<uint64_t>{24 * kGiB}), Device{}),
            "[checkpoint engine] Bucket size: 3072 MiB per buffer (12.5% of 24.00 GiB minimum total host memory).");
}

TEST(BucketSize, BelowOneMiBRejected) {
  Error e = sizing_error(with_ratio(0.01), {64 * kMiB, 99 * kMiB});  // 671088 bytes
  EXPECT_EQ(e.kind(), ErrorKind::kConfig);
  EXPECT_THAT(e.what(), AllOf(HasSubstr("less than 1 MiB per buffer"), HasSubstr("0.01"),
                              HasSubstr(std::to_string(64 * kMiB)), HasSubstr("671088")));
  EXPECT_EQ(sizing_error(with_ratio(0.05), {0, 80 * kGiB}).kind(), ErrorKind::kConfig);  // a worker reports 0
}

TEST(BucketSize, EmptyWorkerListRejected) {
  EXPECT_THAT(sizing_error(with_ratio(0.05), {}).what(), HasSubstr("at least one worker"));
  RefitConfig explicit_size;
  explicit_size.bucket_bytes = 64 * kMiB;
  EXPECT_EQ(sizing_error(explicit_size, {}).kind(), ErrorKind::kConfig);
}

TEST(BucketSize, BadRatioFromCodeRejected) {
  for (double r : {0.0, -0.1, 0.5, 0.6, std::nan(""), double(INFINITY)}) {
    Error e = sizing_error(with_ratio(r), {80 * kGiB});
    EXPECT_EQ(e.kind(), ErrorKind::kConfig);
    EXPECT_THAT(e.what(), HasSubstr("update_weights_bucket_memory_ratio"));
  }
}

TEST(BucketSize, ExplicitBucketBytes) {
  RefitConfig c;
  c.bucket_bytes = 17;  // any size >= 1 byte, even below 1 MiB
  std::vector<uint64_t> memory = {80 * kGiB};
  BucketSize size = resolve_bucket_size(c, memory);
  EXPECT_EQ(size, (BucketSize{17, 0, 0}));
  EXPECT_EQ(bucket_size_line(size, Device{}),
            "[checkpoint engine] Bucket size: 17 bytes per buffer (set by refit_cfg.nixl.bucket_bytes).");
  c.bucket_bytes = 256 * kMiB;
  EXPECT_EQ(bucket_size_line(resolve_bucket_size(c, memory), Device{Device::Kind::kCuda, -1}),
            "[checkpoint engine] Bucket size: 256 MiB per buffer (set by refit_cfg.nixl.bucket_bytes).");
  c.bucket_bytes = 0;
  EXPECT_THAT(sizing_error(c, memory).what(), HasSubstr("bucket_bytes"));
}

TEST(BucketSize, FromParsedConfig) {
  RefitConfig c = parse_config("refit_cfg:\n  nixl:\n    update_weights_bucket_memory_ratio: 0.1\n");
  std::vector<uint64_t> memory = {40 * kGiB, 80 * kGiB};
  EXPECT_EQ(resolve_bucket_size(c, memory).bytes, 4096 * kMiB);
}

}  // namespace
}  // namespace refit
