// Manifest replay: a refit of the same model makes the same manifests, so after the first refit
// of a connection a source sends each unchanged bucket as "bucket k of the refit before", and
// the destination takes the manifest it kept. What changes goes in full, and whatever either side
// cannot vouch for (a failed refit, a manifest it does not have) is never replayed.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/error_of.h"
#include "engine/assembler.h"
#include "engine/protocol.h"
#include "engine_harness.h"

namespace refit {
namespace {

using testing::expect_same;
using ::testing::HasSubstr;
using testing::make_tensor;
using testing::OwnedTensor;
using testing::Pair;
using testing::Received;
using testing::RogueSource;

// Twelve 32-byte tensors: two to a 64-byte bucket, six buckets.
std::vector<OwnedTensor> twelve(uint32_t seed) {
  std::vector<OwnedTensor> out;
  for (int i = 0; i < 12; ++i)
    out.push_back(make_tensor("layers." + std::to_string(i) + ".w", DType::kFloat32, {8}, seed + i));
  return out;
}

TEST(Replay, AnUnchangedModelReplaysEveryBucketAfterTheFirstRefit) {
  for (bool mapped : {true, false}) {
    Pair p(64, false, 10.0, mapped);
    p.connect();
    for (uint32_t refit = 0; refit < 3; ++refit) {
      const auto weights = twelve(100 * refit);  // new values, the same tensors
      Received got;
      const ReceiveStats stats = p.refit(weights, got);
      expect_same(weights, got);
      ASSERT_EQ(p.sent_stats.buckets, 6u);
      const uint64_t replayed = refit == 0 ? 0 : 6;
      EXPECT_EQ(p.sent_stats.replayed_buckets, replayed) << "refit " << refit << (mapped ? " mapped" : " staged");
      EXPECT_EQ(stats.replayed_buckets, replayed) << "refit " << refit;
      EXPECT_FALSE(p.destination->stale());
    }
  }
}

TEST(Replay, BucketsFromTheFirstChangeOnGoInFull) {
  Pair p(64);
  p.connect();
  Received first;
  p.refit(twelve(1), first);
  // Tensor 5 (bucket 2) changes shape: buckets 0 and 1 replay; 2 and every later one (whose
  // places shift) go in full, and every tensor arrives as it is now.
  auto changed = twelve(2);
  changed[5] = make_tensor("layers.5.w", DType::kFloat32, {4}, 77);
  Received got;
  const ReceiveStats stats = p.refit(changed, got);
  expect_same(changed, got);
  EXPECT_EQ(p.sent_stats.replayed_buckets, 2u);
  EXPECT_EQ(stats.replayed_buckets, 2u);
  // The next refit replays the changed model's manifests.
  Received again;
  p.refit(changed, again);
  expect_same(changed, again);
  EXPECT_EQ(p.sent_stats.replayed_buckets, p.sent_stats.buckets);
  // A renamed tensor, one tensor fewer: never replayed past the change.
  auto renamed = changed;
  renamed[0] = make_tensor("layers.0.v", DType::kFloat32, {8}, 5);
  Received r;
  p.refit(renamed, r);
  expect_same(renamed, r);
  EXPECT_EQ(p.sent_stats.replayed_buckets, 0u);
  auto fewer = renamed;
  fewer.pop_back();
  Received f;
  p.refit(fewer, f);
  expect_same(fewer, f);
  // The last bucket holds one tensor instead of two.
  EXPECT_EQ(p.sent_stats.replayed_buckets, p.sent_stats.buckets - 1);
}

TEST(Replay, AfterAFailedRefitEveryManifestGoesInFull) {
  Pair p(64);
  p.connect();
  Received first;
  p.refit(twelve(1), first);
  // The loader fails at the last batch of the second refit, when the destination has every
  // manifest of it: both sides fail the refit.
  const auto second = twelve(2);
  auto sending = p.start_send(second);
  int batches = 0;
  EXPECT_THROW(p.destination->receive([&](LoadBatch) {
    if (++batches == 6) throw std::runtime_error("the loader ran out of memory");
  }),
               Error);
  EXPECT_THROW(sending.get(), Error);
  EXPECT_TRUE(p.destination->stale());
  // The same connection refits again; it must not lean on either side's memory of the failed
  // refit (the destination may have every manifest of it, or not).
  const auto weights = twelve(3);
  Received got;
  const ReceiveStats stats = p.refit(weights, got);
  expect_same(weights, got);
  EXPECT_EQ(p.sent_stats.replayed_buckets, 0u);
  EXPECT_EQ(stats.replayed_buckets, 0u);
  Received again;
  p.refit(weights, again);
  EXPECT_EQ(p.sent_stats.replayed_buckets, 6u);
}

TEST(Replay, ADestinationRefusesAReplayOfAManifestItDoesNotHave) {
  RogueSource rogue;
  protocol::BucketReady replay;
  replay.refit = rogue.first_refit + 1;
  replay.is_last = true;
  replay.used_bytes = 32;
  replay.replay_of = rogue.first_refit;  // no refit came before: the destination has nothing
  replay.manifest = nullptr;
  rogue.send(protocol::encode(replay));
  Received got;
  EXPECT_THAT(testing::error_of(ErrorKind::kProtocol, [&] { rogue.destination.receive(got.loader()); }),
              HasSubstr("replayed the manifest of bucket 0 of refit"));
  EXPECT_TRUE(rogue.destination.stale());
}

TEST(Replay, AReplayMustKeepTheBytesItsManifestWasCheckedFor) {
  RogueSource rogue;
  // Refit 1: one tensor of 32 bytes in bucket 0, in full.
  protocol::BucketReady full;
  full.refit = rogue.first_refit + 1;
  full.is_last = true;
  full.used_bytes = 32;
  protocol::edit_manifest(full).entries.push_back({{"w", DType::kFloat32, {8}}, Box::whole(), 0, 32, 0});
  rogue.send(protocol::encode(full));
  Received got;
  auto receiving = std::async(std::launch::async, [&] { return rogue.destination.receive(got.loader()); });
  // The destination acknowledges the bucket before the receive returns.
  auto done = protocol::decode_message(
      rogue.transport->receive(rogue.to_destination, deadline_after(std::chrono::seconds(5))), "destination");
  EXPECT_EQ(done.type, protocol::MessageType::kBucketDone);
  receiving.get();
  ASSERT_EQ(got.tensors.size(), 1u);
  // Refit 2 replays it, but claims 64 used bytes: the entries were checked against 32.
  protocol::BucketReady replay = full;
  replay.refit = rogue.first_refit + 2;
  replay.replay_of = rogue.first_refit + 1;
  replay.used_bytes = 64;
  rogue.send(protocol::encode(replay));
  Received again;
  EXPECT_THAT(testing::error_of(ErrorKind::kProtocol, [&] { rogue.destination.receive(again.loader()); }),
              HasSubstr("but that manifest came for [0, +32)"));
}

TEST(Replay, TheWireCarriesOnlyTheBucketsNumbers) {
  protocol::BucketReady b;
  b.refit = 9;
  b.seq = 3;
  b.offset = 64;
  b.used_bytes = 48;
  b.checksum = 0xabcdef;
  for (int i = 0; i < 100; ++i)
    protocol::edit_manifest(b).entries.push_back(
        {{"t" + std::to_string(i), DType::kUInt8, {1}}, Box::whole(), 0, 1, static_cast<uint64_t>(i % 48)});
  const size_t full = protocol::encode(b).size();
  b.replay_of = 8;
  const Bytes replay = protocol::encode(b);
  EXPECT_LT(replay.size(), 80u);
  EXPECT_GT(full, 100 * replay.size() / 10);
  const auto back = protocol::decode_message(replay, "source rank 0").ready;
  EXPECT_EQ(back.replay_of, std::optional<uint64_t>(8));
  EXPECT_EQ(back.manifest, nullptr);  // the destination fills it from what it kept
  EXPECT_EQ(back.checksum, std::optional<uint64_t>(0xabcdef));
  EXPECT_EQ(back.used_bytes, 48u);
  EXPECT_NO_THROW(protocol::validate(back, 64, 128, SourceAccess::kNone, "source rank 0"));
}

// The assembler records the names of a replayed refit only once a bucket is new: a name in it
// that a replayed bucket had delivered is still caught.
TEST(Replay, TheAssemblerCatchesUpOnNamesWhenABucketIsNew) {
  std::vector<std::byte> bytes(64, std::byte{1});
  const protocol::BucketBytes bases{bytes.data(), {}};
  auto bucket = [](uint64_t seq, const std::string& name) {
    protocol::BucketReady b;
    b.seq = seq;
    b.used_bytes = 32;
    protocol::edit_manifest(b).entries.push_back({{name, DType::kFloat32, {8}}, Box::whole(), 0, 32, 0});
    return b;
  };
  const auto deadline = deadline_after(std::chrono::seconds(5));
  TensorAssembler a;
  EXPECT_EQ(a.add_bucket(bucket(0, "a"), bases, "source rank 0", deadline, /*repeats_checked=*/true).size(), 1u);
  EXPECT_EQ(a.add_bucket(bucket(1, "b"), bases, "source rank 0", deadline, true).size(), 1u);
  EXPECT_THAT(testing::error_of(ErrorKind::kProtocol,
                                [&] { a.add_bucket(bucket(2, "a"), bases, "source rank 0", deadline, false); }),
              HasSubstr("tensor 'a' delivered twice in one refit"));
  EXPECT_EQ(a.tensors_completed(), 2u);
}

}  // namespace
}  // namespace refit
