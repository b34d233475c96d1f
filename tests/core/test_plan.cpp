#include <gtest/gtest.h>

#include "refit/error.h"
#include "refit/plan.h"

namespace refit {
namespace {

TensorInfo t(std::string name, DType dtype, std::vector<int64_t> shape) {
  return {std::move(name), dtype, std::move(shape)};
}

TEST(Plan, TensorOfExactlyOneBucketFillsIt) {
  std::vector<TensorInfo> ts = {t("a", DType::kFloat32, {16}), t("b", DType::kFloat32, {1})};
  auto plan = plan_buckets(ts, 64);
  ASSERT_EQ(plan.buckets.size(), 2u);
  EXPECT_EQ(plan.buckets[0].used_bytes, 64u);
  ASSERT_EQ(plan.buckets[0].chunks.size(), 1u);
  EXPECT_EQ(plan.buckets[0].chunks[0].placement.size, 64u);
  EXPECT_EQ(plan.buckets[1].chunks[0].tensor, 1u);
  EXPECT_EQ(plan.buckets[1].chunks[0].placement.bucket_offset, 0u);
}

TEST(Plan, TensorOverTwoBucketsSplitsInOrder) {
  std::vector<TensorInfo> ts = {t("big", DType::kBFloat16, {40})};  // 80 bytes
  auto plan = plan_buckets(ts, 64);
  ASSERT_EQ(plan.buckets.size(), 2u);
  EXPECT_EQ(plan.buckets[0].chunks[0].placement.tensor_offset, 0u);
  EXPECT_EQ(plan.buckets[0].chunks[0].placement.size, 64u);
  EXPECT_EQ(plan.buckets[1].chunks[0].placement.tensor_offset, 64u);
  EXPECT_EQ(plan.buckets[1].chunks[0].placement.size, 16u);
  EXPECT_EQ(plan.transferred_bytes, 80u);
}

TEST(Plan, MixedDtypesAreAlignedToTheirElementSize) {
  // bf16[3] ends at byte 6; fp32 must start at 8, int64 at 16, fp8 right after.
  std::vector<TensorInfo> ts = {t("a", DType::kBFloat16, {3}), t("b", DType::kFloat32, {1}), t("c", DType::kInt64, {1}),
                                t("d", DType::kFloat8E4M3FN, {3}), t("e", DType::kFloat64, {1})};
  auto plan = plan_buckets(ts, 1024);
  ASSERT_EQ(plan.buckets.size(), 1u);
  const auto& c = plan.buckets[0].chunks;
  EXPECT_EQ(c[0].placement.bucket_offset, 0u);
  EXPECT_EQ(c[1].placement.bucket_offset, 8u);
  EXPECT_EQ(c[2].placement.bucket_offset, 16u);
  EXPECT_EQ(c[3].placement.bucket_offset, 24u);
  EXPECT_EQ(c[4].placement.bucket_offset, 32u);
  EXPECT_EQ(plan.buckets[0].used_bytes, 40u);
}

TEST(Plan, OddBucketSizeSplitsIntoWholeElements) {
  std::vector<TensorInfo> ts = {t("w", DType::kFloat32, {10})};  // 40 bytes, 17-byte buckets
  auto plan = plan_buckets(ts, 17);
  ASSERT_EQ(plan.buckets.size(), 3u);  // 16 + 16 + 8 bytes: chunks hold whole elements
  uint64_t covered = 0;
  for (const auto& b : plan.buckets) {
    for (const auto& ch : b.chunks) {
      EXPECT_EQ(ch.placement.tensor_offset, covered);
      EXPECT_EQ(ch.placement.size % 4, 0u);
      EXPECT_LE(ch.placement.bucket_offset + ch.placement.size, 17u);
      covered += ch.placement.size;
    }
  }
  EXPECT_EQ(covered, 40u);
}

TEST(Plan, BucketSmallerThanAnElementCarriesBytes) {
  std::vector<TensorInfo> ts = {t("w", DType::kFloat64, {2})};  // 16 bytes, 3-byte buckets
  auto plan = plan_buckets(ts, 3);
  EXPECT_EQ(plan.buckets.size(), 6u);
  EXPECT_EQ(plan.transferred_bytes, 16u);
}

TEST(Plan, ZeroSizeTensorsAreDelivered) {
  std::vector<TensorInfo> ts = {t("empty", DType::kFloat32, {0, 8}), t("x", DType::kUInt8, {5}),
                                t("empty2", DType::kBFloat16, {0})};
  auto plan = plan_buckets(ts, 8);
  size_t chunks = 0;
  for (const auto& b : plan.buckets) chunks += b.chunks.size();
  EXPECT_EQ(chunks, 3u);
  EXPECT_EQ(plan.payload_bytes, 5u);
}

TEST(Plan, EmptyStreamHasOneEmptyBucket) {
  auto plan = plan_buckets({}, 64);
  ASSERT_EQ(plan.buckets.size(), 1u);
  EXPECT_TRUE(plan.buckets[0].chunks.empty());
  EXPECT_EQ(plan.buckets[0].used_bytes, 0u);
}

TEST(Plan, RepeatedNameIsAnError) {
  std::vector<TensorInfo> ts = {t("w", DType::kFloat32, {1}), t("w", DType::kFloat32, {1})};
  try {
    plan_buckets(ts, 64);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("'w'"), std::string::npos);
  }
}

TEST(Plan, ZeroBucketIsRejected) { EXPECT_THROW(BucketPacker(0), Error); }

TEST(Plan, SamePlanForSameInput) {
  std::vector<TensorInfo> ts = {t("a", DType::kBFloat16, {1000}), t("b", DType::kFloat32, {7}),
                                t("c", DType::kInt8, {333})};
  auto p1 = plan_buckets(ts, 500);
  auto p2 = plan_buckets(ts, 500);
  ASSERT_EQ(p1.buckets.size(), p2.buckets.size());
  for (size_t i = 0; i < p1.buckets.size(); ++i) {
    ASSERT_EQ(p1.buckets[i].chunks.size(), p2.buckets[i].chunks.size());
    for (size_t j = 0; j < p1.buckets[i].chunks.size(); ++j) {
      EXPECT_EQ(p1.buckets[i].chunks[j].placement.bucket_offset, p2.buckets[i].chunks[j].placement.bucket_offset);
    }
  }
}

// Where a source puts a piece: the one rule the engine's LinkSender and the planner's model both
// follow. Mapped: any non-empty contiguous piece. Read: a contiguous piece of at least
// kMinSourceReadBytes, or a smaller one that continues the read before it. Anything else is packed.
TEST(RoutePiece, MapsOrReadsContiguousPiecesAndPacksTheRest) {
  const uint64_t large = kMinSourceReadBytes, small = kMinSourceReadBytes - 1;
  EXPECT_EQ(route_piece(SourceAccess::kMap, true, 1), PieceRoute::kMap);
  EXPECT_EQ(route_piece(SourceAccess::kMap, true, 0), PieceRoute::kPack);  // an empty tensor: its name in a bucket
  EXPECT_EQ(route_piece(SourceAccess::kMap, false, large), PieceRoute::kPack);
  EXPECT_EQ(route_piece(SourceAccess::kRead, true, large), PieceRoute::kRead);
  EXPECT_EQ(route_piece(SourceAccess::kRead, true, small), PieceRoute::kPack);
  EXPECT_EQ(route_piece(SourceAccess::kRead, true, small, /*continues_read=*/true), PieceRoute::kRead);
  EXPECT_EQ(route_piece(SourceAccess::kRead, false, large, true), PieceRoute::kPack);  // strided
  EXPECT_EQ(route_piece(SourceAccess::kNone, true, large, true), PieceRoute::kPack);
}

}  // namespace
}  // namespace refit
