#include <gtest/gtest.h>

#include "core/error_of.h"
#include "engine/protocol.h"
#include "refit/error.h"

namespace refit::protocol {
namespace {

BucketReady sample_bucket() {
  BucketReady m;
  m.refit = 3;
  m.seq = 7;
  m.offset = 1024;
  m.is_last = true;
  m.used_bytes = 48;
  edit_manifest(m).entries.push_back({{"a.weight", DType::kBFloat16, {4, 4}}, Box::whole(), 0, 32, 0});
  edit_manifest(m).entries.push_back({{"b.bias", DType::kFloat32, {4}}, Box::whole(), 0, 16, 32});
  return m;
}

// What validate() says of a bucket of a 1024-byte link whose source has 2048 bytes of buffers.
std::string message_of(const BucketReady& bad) {
  try {
    validate(bad, 1024, 2048, "source rank 0");
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kProtocol);
    return std::string(e.what());
  }
  return std::string("accepted");
}

EngineMetadata sample_metadata() {
  EngineMetadata md;
  md.session = new_session_id();
  md.model_fingerprint = 42;
  md.bucket_bytes = 1024;
  md.transport_name = "UCX";
  md.transport_address = {1, 2, 3};
  md.buffers = {0x1000, 2048, {9, 9}};
  return md;
}

TEST(Protocol, BucketMessageRoundTrips) {
  auto m = sample_bucket();
  auto decoded = decode_message(encode(m), "source rank 0");
  ASSERT_EQ(decoded.type, MessageType::kBucketReady);
  EXPECT_EQ(decoded.ready.seq, 7u);
  EXPECT_TRUE(decoded.ready.is_last);
  ASSERT_EQ(decoded.ready.entries().size(), 2u);
  EXPECT_EQ(decoded.ready.entries()[1].tensor.name, "b.bias");
  EXPECT_EQ(decoded.ready.entries()[1].bucket_offset, 32u);
  EXPECT_NO_THROW(validate(decoded.ready, 1024, 2048, "source rank 0"));
}

// The byte layout of a message, little-endian whatever the host: magic "RMSG", u32 version, u8
// type, u64 refit, u64 seq.
TEST(Protocol, MessagesAreLittleEndianOnTheWire) {
  BucketDone done;
  done.refit = 0x0102030405060708;
  done.seq = 0x1122;
  const Bytes expected = {
      'R', 'M', 'S', 'G', static_cast<uint8_t>(kVersion), 0, 0, 0, 2, 8, 7, 6, 5, 4, 3, 2, 1, 0x22, 0x11, 0, 0,
      0,   0,   0,   0};
  EXPECT_EQ(encode(done), expected);
  EXPECT_EQ(decode_message(expected, "source rank 0").done.refit, 0x0102030405060708u);
}

TEST(Protocol, APieceRoundTripsAndMustFitItsTensor) {
  auto m = sample_bucket();
  // Rows [1, 3) x columns [2, 4) of a 4 x 4 tensor: 8 bytes of bf16.
  edit_manifest(m).entries[0].box = Box::of(Request::narrow(0, 1, 2)).narrowed({1, 2, 2});
  edit_manifest(m).entries[0].size = 8;
  edit_manifest(m).entries[1].bucket_offset = 8;
  m.used_bytes = 24;
  auto decoded = decode_message(encode(m), "source rank 0");
  EXPECT_EQ(decoded.ready.entries()[0].box, m.entries()[0].box);
  EXPECT_EQ(decoded.ready.offset, 1024u);
  EXPECT_NO_THROW(validate(decoded.ready, 1024, 2048, "source rank 0"));
  auto bad = m;
  edit_manifest(bad).entries[0].size = 16;  // more than the piece's 8 bytes
  EXPECT_THROW(validate(bad, 1024, 2048, "s"), Error);
  bad = m;
  edit_manifest(bad).entries[0].box.cuts[1].start = 3;  // columns [3, 5) of 4
  EXPECT_THROW(validate(bad, 1024, 2048, "s"), Error);
  bad = m;
  edit_manifest(bad).entries[0].box.cuts[1].dim = 2;  // a 2-D tensor has no dim 2
  EXPECT_THROW(validate(bad, 1024, 2048, "s"), Error);
}

TEST(Protocol, EveryTruncationOfEveryMessageIsAProtocolError) {
  BucketReady replay = sample_bucket();
  replay.replay_of = 2;
  std::vector<Bytes> messages = {encode(sample_bucket()), encode(replay), encode(BucketDone{1, 2}),
                                 encode(Abort{1, ErrorKind::kIntegrity, "why"})};
  for (const auto& full : messages) {
    for (size_t n = 0; n < full.size(); ++n) {
      Bytes cut(full.begin(), full.begin() + n);
      try {
        decode_message(cut, "source rank 0");
        FAIL() << "truncation to " << n << " bytes was accepted";
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kProtocol);
        EXPECT_NE(std::string(e.what()).find("source rank 0"), std::string::npos);
      }
    }
  }
}

TEST(Protocol, MetadataRoundTripsAndTruncationsAreRejected) {
  auto md = sample_metadata();
  auto blob = encode(md);
  auto back = decode_metadata(blob, "metadata of source rank 1");
  EXPECT_EQ(back.session, md.session);
  EXPECT_EQ(back.buffers.key, md.buffers.key);
  EXPECT_EQ(back.buffers.length, md.buffers.length);
  for (size_t n = 0; n < blob.size(); ++n) {
    Bytes cut(blob.begin(), blob.begin() + n);
    EXPECT_THROW(decode_metadata(cut, "m"), Error) << n;
  }
  Bytes longer = blob;
  longer.push_back(0);
  EXPECT_THROW(decode_metadata(longer, "m"), Error);
}

TEST(Protocol, OtherVersionIsRefused) {
  auto blob = encode(sample_metadata());
  blob[4] = 99;
  try {
    decode_metadata(blob, "metadata of destination rank 0");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("version 99"), std::string::npos);
  }
}

TEST(Protocol, ValidationRejectsRangesOutsideBucketOrTensor) {
  auto m = sample_bucket();
  edit_manifest(m).entries[1].bucket_offset = 40;  // 40 + 16 > 48 used
  EXPECT_THROW(validate(m, 1024, 2048, "s"), Error);
  m = sample_bucket();
  m.used_bytes = 2048;  // more than the bucket
  EXPECT_THROW(validate(m, 1024, 2048, "s"), Error);
  m = sample_bucket();
  edit_manifest(m).entries[0].tensor_offset = 8;  // 8 + 32 > 32 bytes of tensor
  EXPECT_THROW(validate(m, 1024, 2048, "s"), Error);
  m = sample_bucket();
  edit_manifest(m).entries[0].tensor.shape = {INT64_MAX, INT64_MAX};
  EXPECT_THROW(validate(m, 1024, 2048, "s"), Error);
  m = sample_bucket();
  m.offset = 2010;  // 2010 + 48 bytes run past the source's 2048-byte region
  EXPECT_THROW(validate(m, 1024, 2048, "s"), Error);
}

// Entries sent in place name a region of the source's own memory; they must lie inside it, and
// every region must be used.
TEST(Protocol, InPlaceEntriesRoundTripAndMustFitTheirSourceRegion) {
  auto m = sample_bucket();
  edit_manifest(m).regions = {{{0x7f0000000000, 4096, {1, 2, 3}}, MemoryKind::kCuda}};
  edit_manifest(m).entries.push_back({{"c.weight", DType::kBFloat16, {1024}}, Box::whole(), 0, 2048, 2048, 1});
  auto back = decode_message(encode(m), "source rank 0").ready;
  ASSERT_EQ(back.regions().size(), 1u);
  EXPECT_EQ(back.regions()[0].remote.address, 0x7f0000000000u);
  EXPECT_EQ(back.regions()[0].remote.key, (Bytes{1, 2, 3}));
  EXPECT_EQ(back.regions()[0].memory, MemoryKind::kCuda);
  EXPECT_EQ(back.entries()[2].region, 1u);
  EXPECT_TRUE(back.has_in_place_entries());
  EXPECT_NO_THROW(validate(back, 1024, 2048, "source rank 0"));
  auto bad = m;
  edit_manifest(bad).entries[2].bucket_offset = 2049;  // 2049 + 2048 > 4096
  EXPECT_NE(message_of(bad).find("outside the 4096 bytes of source region 1"), std::string::npos) << message_of(bad);
  bad = m;
  edit_manifest(bad).entries[2].region = 2;
  EXPECT_NE(message_of(bad).find("names region 2 of 1"), std::string::npos) << message_of(bad);
  bad = m;
  const SourceRegion again = bad.regions()[0];
  edit_manifest(bad).regions.push_back(again);
  EXPECT_NE(message_of(bad).find("source region 2 is used by no chunk"), std::string::npos) << message_of(bad);
  // An in-place entry may lie beyond the bucket's used bytes: it is not in the bucket.
  EXPECT_GT(m.entries()[2].bucket_offset, m.used_bytes);
}

// A bucket of spans, for a destination that reads the source's memory: its entries lie in the
// bucket; each span is read from the bucket's buffer (region 0, at the same offset) or from a
// source region. Spans are ordered, inside the used bytes and their region.
TEST(Protocol, SpansRoundTripAndMustFitTheBucketAndTheirRegion) {
  auto m = sample_bucket();  // entries at [0, 32) and [32, 48)
  edit_manifest(m).regions = {{{0x7f0000000000, 4096, {1, 2, 3}}, MemoryKind::kHost}};
  edit_manifest(m).spans = {{0, 32, 1, 1000}, {32, 16, 0, 32}};
  auto back = decode_message(encode(m), "source rank 0").ready;
  ASSERT_EQ(back.spans().size(), 2u);
  EXPECT_EQ(back.spans()[0].region, 1u);
  EXPECT_EQ(back.spans()[0].source_offset, 1000u);
  EXPECT_EQ(back.spans()[1].bucket_offset, 32u);
  EXPECT_EQ(back.spans()[1].size, 16u);
  EXPECT_FALSE(back.has_in_place_entries());  // its region is read, not mapped
  EXPECT_NO_THROW(validate(back, 1024, 2048, "source rank 0"));
  auto bad = back;
  edit_manifest(bad).spans[0].source_offset = 4090;  // 4090 + 32 > 4096
  EXPECT_NE(message_of(bad).find("span 0 at [4090, +32) lies outside the 4096 bytes of source region 1"),
            std::string::npos)
      << message_of(bad);
  bad = back;
  edit_manifest(bad).spans[1].bucket_offset = 24;  // overlaps span 0
  EXPECT_NE(message_of(bad).find("span 1 at [24, +16) overlaps"), std::string::npos) << message_of(bad);
  bad = back;
  edit_manifest(bad).spans[1].size = 17;  // past the 48 used bytes
  EXPECT_NE(message_of(bad).find("lies outside the 48 used bytes"), std::string::npos) << message_of(bad);
  bad = back;
  edit_manifest(bad).spans[1].source_offset = 40;  // region 0 is read at the bucket's own offsets
  EXPECT_NE(message_of(bad).find("span 1 of its buffer is at offset 40, not 32"), std::string::npos) << message_of(bad);
  bad = back;
  edit_manifest(bad).spans[0].region = 2;
  EXPECT_NE(message_of(bad).find("span 0 names region 2 of 1"), std::string::npos) << message_of(bad);
  bad = back;
  edit_manifest(bad).spans[0].region = 0;
  edit_manifest(bad).spans[0].source_offset = 0;
  EXPECT_NE(message_of(bad).find("source region 1 is used by no chunk"), std::string::npos) << message_of(bad);
  bad = back;
  edit_manifest(bad).entries[0].region = 1;
  EXPECT_NE(message_of(bad).find("is in place (region 1) in a bucket of spans"), std::string::npos) << message_of(bad);
  // Every truncation of a bucket of spans is refused.
  const Bytes wire = encode(back);
  for (size_t n = 0; n < wire.size(); ++n)
    EXPECT_THROW(decode_message(std::span(wire.data(), n), "source rank 0"), Error) << n;
}

TEST(Protocol, MetadataCarriesHowADestinationReachesSourceMemory) {
  auto md = sample_metadata();
  md.reads_source_memory = true;
  auto back = decode_metadata(encode(md), "metadata of destination rank 0");
  EXPECT_TRUE(back.reads_source_memory);
  EXPECT_FALSE(back.reads_in_place);
  auto blob = encode(md);
  blob[blob.size() - 1 - 8 - 1] = 2;  // reads_source_memory; the delta flag and weights version follow
  EXPECT_THROW(decode_metadata(blob, "metadata of destination rank 0"), Error);
}

TEST(Protocol, MetadataCarriesTheDeltaSettingAndTheWeightsVersion) {
  auto md = sample_metadata();
  md.delta = true;
  md.weights_version = 0x0123456789abcdefull;
  auto back = decode_metadata(encode(md), "metadata of destination rank 0");
  EXPECT_TRUE(back.delta);
  EXPECT_EQ(back.weights_version, 0x0123456789abcdefull);
  auto blob = encode(md);
  blob[blob.size() - 1 - 8] = 2;  // the delta flag
  std::string message;
  EXPECT_EQ(testing::error_kind_of([&] { decode_metadata(blob, "metadata of destination rank 0"); }, &message),
            ErrorKind::kProtocol);
  EXPECT_NE(message.find("delta = 2"), std::string::npos) << message;
}

}  // namespace
}  // namespace refit::protocol
