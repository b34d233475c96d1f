#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/error_of.h"
#include "engine/protocol.h"
#include "refit/error.h"

namespace refit::protocol {
namespace {

using ::testing::HasSubstr;

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
std::string message_of(const BucketReady& bad, SourceAccess access = SourceAccess::kNone) {
  try {
    validate(bad, 1024, 2048, access, "source rank 0");
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
  EXPECT_NO_THROW(validate(decoded.ready, 1024, 2048, SourceAccess::kNone, "source rank 0"));
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
  EXPECT_NO_THROW(validate(decoded.ready, 1024, 2048, SourceAccess::kNone, "source rank 0"));
  auto bad = m;
  edit_manifest(bad).entries[0].size = 16;  // more than the piece's 8 bytes
  EXPECT_THROW(validate(bad, 1024, 2048, SourceAccess::kNone, "s"), Error);
  bad = m;
  edit_manifest(bad).entries[0].box.cuts[1].start = 3;  // columns [3, 5) of 4
  EXPECT_THROW(validate(bad, 1024, 2048, SourceAccess::kNone, "s"), Error);
  bad = m;
  edit_manifest(bad).entries[0].box.cuts[1].dim = 2;  // a 2-D tensor has no dim 2
  EXPECT_THROW(validate(bad, 1024, 2048, SourceAccess::kNone, "s"), Error);
}

TEST(Protocol, EveryTruncationOfEveryMessageIsAProtocolError) {
  BucketReady replay = sample_bucket();
  replay.replay_of = 2;
  std::vector<Bytes> messages = {encode(sample_bucket()), encode(replay), encode(BucketDone{1, 2}),
                                 encode(Abort{1, ErrorKind::kIntegrity, "why"}),
                                 encode(Abort{1, ErrorKind::kPeerLost, "bye", /*farewell=*/true})};
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

// A refit's messages concern that refit only; a farewell concerns every refit of its connection
// (numbered from first_refit) and none of another's.
TEST(Protocol, AFarewellConcernsEveryRefitOfItsConnectionAndNoOther) {
  const uint64_t first = first_refit(11, 22), other = first_refit(33, 22);
  auto decoded = [](const Bytes& b) { return decode_message(b, "source rank 0"); };
  const Message bucket = decoded(encode(BucketDone{first + 3, 0}));
  EXPECT_TRUE(concerns(bucket, first + 3, first));
  EXPECT_FALSE(concerns(bucket, first + 4, first));
  const Message abort = decoded(encode(Abort{first + 3, ErrorKind::kIntegrity, "why"}));
  EXPECT_FALSE(abort.abort.farewell);
  EXPECT_FALSE(concerns(abort, first + 4, first));
  const Message farewell = decoded(encode(Abort{first + 3, ErrorKind::kPeerLost, "it called finalize()", true}));
  EXPECT_TRUE(farewell.abort.farewell);
  for (uint64_t k : {0, 1, 3, 4, 1000}) EXPECT_TRUE(concerns(farewell, first + k, first)) << k;
  EXPECT_FALSE(concerns(farewell, other + 3, other));
  const std::string message = testing::error_of(
      ErrorKind::kPeerLost, [&] { raise_abort(farewell.abort, "destination rank 1", "bucket 0 done"); });
  EXPECT_EQ(message, "destination rank 1 left this connection while we waited for bucket 0 done: it called finalize()");
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
  EXPECT_THROW(validate(m, 1024, 2048, SourceAccess::kNone, "s"), Error);
  m = sample_bucket();
  m.used_bytes = 2048;  // more than the bucket
  EXPECT_THROW(validate(m, 1024, 2048, SourceAccess::kNone, "s"), Error);
  m = sample_bucket();
  edit_manifest(m).entries[0].tensor_offset = 8;  // 8 + 32 > 32 bytes of tensor
  EXPECT_THROW(validate(m, 1024, 2048, SourceAccess::kNone, "s"), Error);
  m = sample_bucket();
  edit_manifest(m).entries[0].tensor.shape = {INT64_MAX, INT64_MAX};
  EXPECT_THROW(validate(m, 1024, 2048, SourceAccess::kNone, "s"), Error);
  m = sample_bucket();
  m.offset = 2010;  // 2010 + 48 bytes run past the source's 2048-byte region
  EXPECT_THROW(validate(m, 1024, 2048, SourceAccess::kNone, "s"), Error);
}

// Entries sent in place name a region of the source's own memory and where they lie in it; they
// must lie inside it, come only on a link that takes source memory, and every region must be used.
// On a link that maps, such an entry takes no room in the bucket (bucket offset 0).
TEST(Protocol, InPlaceEntriesRoundTripAndMustFitTheirSourceRegion) {
  auto m = sample_bucket();
  edit_manifest(m).regions = {{{0x7f0000000000, 4096, {1, 2, 3}}, MemoryKind::kCuda}};
  edit_manifest(m).entries.push_back({{"c.weight", DType::kBFloat16, {1024}}, Box::whole(), 0, 2048, 0, 1, 2048});
  auto back = decode_message(encode(m), "source rank 0").ready;
  ASSERT_EQ(back.regions().size(), 1u);
  EXPECT_EQ(back.regions()[0].remote.address, 0x7f0000000000u);
  EXPECT_EQ(back.regions()[0].remote.key, (Bytes{1, 2, 3}));
  EXPECT_EQ(back.regions()[0].memory, MemoryKind::kCuda);
  EXPECT_EQ(back.entries()[2].region, 1u);
  EXPECT_EQ(back.entries()[2].source_offset, 2048u);
  EXPECT_EQ(back.entries()[0].source_offset, 0u);
  EXPECT_NO_THROW(validate(back, 1024, 2048, SourceAccess::kMap, "source rank 0"));
  EXPECT_NE(message_of(m).find("is in place (source region 1), but this link takes nothing from the source's memory"),
            std::string::npos)
      << message_of(m);
  auto bad = m;
  edit_manifest(bad).entries[2].source_offset = 2049;  // 2049 + 2048 > 4096
  EXPECT_NE(message_of(bad, SourceAccess::kMap).find("at [2049, +2048) lies outside the 4096 bytes of source region 1"),
            std::string::npos)
      << message_of(bad, SourceAccess::kMap);
  bad = m;
  edit_manifest(bad).entries[2].region = 2;
  EXPECT_NE(message_of(bad, SourceAccess::kMap).find("names region 2 of 1"), std::string::npos);
  bad = m;
  const SourceRegion again = bad.regions()[0];
  edit_manifest(bad).regions.push_back(again);
  EXPECT_NE(message_of(bad, SourceAccess::kMap).find("source region 2 is used by no chunk"), std::string::npos);
  bad = m;
  edit_manifest(bad).entries[2].bucket_offset = 8;
  EXPECT_NE(message_of(bad, SourceAccess::kMap).find("is mapped in place but has bucket offset 8"), std::string::npos)
      << message_of(bad, SourceAccess::kMap);
  // On a link that reads it, the same entry must land inside the bucket's used bytes.
  EXPECT_NE(message_of(m, SourceAccess::kRead).find("chunk of 'c.weight' at [0, +2048) lies outside the 48 used bytes"),
            std::string::npos)
      << message_of(m, SourceAccess::kRead);
  // Every truncation is refused.
  const Bytes wire = encode(m);
  for (size_t n = 0; n < wire.size(); ++n)
    EXPECT_THROW(decode_message(std::span(wire.data(), n), "source rank 0"), Error) << n;
}

// On a link that reads source memory, the bucket is laid out as if packed: an entry in place lands
// at its bucket offset, read from its region; read entries are in bucket order, not overlapping.
// bucket_reads() joins neighbours (alignment padding between them comes along) and keeps the
// buffer's bytes and each region's apart.
TEST(Protocol, ALinkThatReadsGetsOneReadPerRunOfNeighbours) {
  BucketReady m;
  m.used_bytes = 12000;
  edit_manifest(m).regions = {{{0x7f0000000000, 1 << 20, {1}}, MemoryKind::kHost}};
  auto entry = [](const char* name, uint64_t size, uint64_t at, uint32_t region = 0, uint64_t from = 0) {
    return ManifestEntry{{name, DType::kUInt8, {static_cast<int64_t>(size)}}, Box::whole(), 0, size, at, region, from};
  };
  edit_manifest(m).entries = {entry("a", 1000, 0, 1, 5000),    entry("b", 996, 1004, 1, 6004),  // 4 bytes of padding
                              entry("c", 100, 2000),           entry("d", 100, 2104),           // packed
                              entry("e", 2000, 2204, 1, 0),    entry("f", 0, 4204),             // a new run; empty
                              entry("g", 1000, 10000, 1, 7796)};  // 5796 past e: too far to join
  EXPECT_NO_THROW(validate(m, 1 << 16, 1 << 17, SourceAccess::kRead, "source rank 0"));
  const auto reads = bucket_reads(*m.manifest, SourceAccess::kRead);
  ASSERT_EQ(reads.size(), 4u);
  EXPECT_EQ(reads[0].region, 1u);
  EXPECT_EQ(reads[0].source_offset, 5000u);
  EXPECT_EQ(reads[0].bucket_offset, 0u);
  EXPECT_EQ(reads[0].size, 2000u);
  EXPECT_EQ(reads[1].region, 0u);
  EXPECT_EQ(reads[1].source_offset, 2000u);  // the buffer: at the bucket's own offsets
  EXPECT_EQ(reads[1].size, 204u);
  EXPECT_EQ(reads[2].source_offset, 0u);
  EXPECT_EQ(reads[2].size, 2000u);
  EXPECT_EQ(reads[3].bucket_offset, 10000u);
  // A link that maps reads only the buffer's bytes; the entries in place are loaded mapped.
  BucketReady mapped = m;
  for (auto& e : edit_manifest(mapped).entries)
    if (e.region > 0) e.bucket_offset = 0;
  EXPECT_NO_THROW(validate(mapped, 1 << 16, 1 << 17, SourceAccess::kMap, "source rank 0"));
  const auto buffer_reads = bucket_reads(*mapped.manifest, SourceAccess::kMap);
  ASSERT_EQ(buffer_reads.size(), 1u);
  EXPECT_EQ(buffer_reads[0].bucket_offset, 2000u);
  EXPECT_EQ(buffer_reads[0].size, 204u);
  // Two read entries landing on one byte would race: refused.
  BucketReady bad = m;
  edit_manifest(bad).entries[1].bucket_offset = 999;
  EXPECT_THAT(testing::error_of(ErrorKind::kProtocol,
                                [&] { validate(bad, 1 << 16, 1 << 17, SourceAccess::kRead, "source rank 0"); }),
              HasSubstr("chunk of 'b' at [999, +996) overlaps the chunk before (ending at 1000)"));
}

// The link's way is worked out alike on both ends from the destination's `takes`, whether the two
// share a host, and what the transport can do.
TEST(Protocol, BothEndsDeriveHowALinkTakesSourceMemory) {
  EngineMetadata destination;
  TransportCapabilities both;
  both.maps_peer_memory = both.reads_registered_memory = true;
  destination.takes = kTakesByMap | kTakesByRead;
  EXPECT_EQ(link_access(destination.takes, /*same_host=*/true, both), SourceAccess::kMap);
  EXPECT_EQ(link_access(destination.takes, /*same_host=*/false, both), SourceAccess::kRead);
  destination.takes = kTakesByMap;
  EXPECT_EQ(link_access(destination.takes, false, both), SourceAccess::kNone);
  destination.takes = kTakesByRead;
  EXPECT_EQ(link_access(destination.takes, true, both), SourceAccess::kRead);
  TransportCapabilities maps_only;
  maps_only.maps_peer_memory = true;
  destination.takes = kTakesByMap | kTakesByRead;
  EXPECT_EQ(link_access(destination.takes, false, maps_only), SourceAccess::kNone);
  destination.takes = 0;
  EXPECT_EQ(link_access(destination.takes, true, both), SourceAccess::kNone);
}

TEST(Protocol, MetadataCarriesHowADestinationReachesSourceMemory) {
  auto md = sample_metadata();
  md.takes = kTakesByRead;
  auto back = decode_metadata(encode(md), "metadata of destination rank 0");
  EXPECT_EQ(back.takes, kTakesByRead);
  auto blob = encode(md);
  blob[blob.size() - 1 - 4 - 1] = 4;  // an unknown way; the delta flag and no weights versions follow
  EXPECT_THROW(decode_metadata(blob, "metadata of destination rank 0"), Error);
}

TEST(Protocol, MetadataCarriesTheDeltaSettingAndTheWeightsVersionOfEachSource) {
  auto md = sample_metadata();
  md.weights_versions = {{0, 0x0123456789abcdefull}, {3, 0xfedcba9876543210ull}};
  for (DeltaMode mode : {DeltaMode::kOff, DeltaMode::kOn, DeltaMode::kAuto}) {
    md.delta = mode;
    auto back = decode_metadata(encode(md), "metadata of destination rank 0");
    EXPECT_EQ(back.delta, mode);
    EXPECT_EQ(back.weights_versions, md.weights_versions);
  }
  auto blob = encode(md);
  blob[blob.size() - 1 - 4 - 2 * 12] = 3;  // the delta mode
  std::string message;
  EXPECT_EQ(testing::error_kind_of([&] { decode_metadata(blob, "metadata of destination rank 0"); }, &message),
            ErrorKind::kProtocol);
  EXPECT_NE(message.find("delta = 3"), std::string::npos) << message;
}

}  // namespace
}  // namespace refit::protocol
