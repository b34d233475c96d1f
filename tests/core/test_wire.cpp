// The wire codec (src/core/wire.h): values round-trip, integers and floats are little-endian
// bytes whatever the host (checked against explicit bytes), and every malformed input is
// Error(kProtocol) naming what was decoded and the field. Field lists (wire_fields.h) write the
// bytes the codec's own calls write, and read them back checking every bound.
#include "core/wire.h"
#include "core/wire_fields.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "core/error_of.h"

namespace refit {
namespace {

using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::ElementsAre;
using testing::error_of;
using ::testing::HasSubstr;

// The codec's own byte order, checked when this file compiles, on whatever host it compiles.
static_assert(wire::encode<uint32_t>(0x01020304) == std::array<uint8_t, 4>{4, 3, 2, 1});
static_assert(wire::decode<uint16_t>(std::span<const uint8_t, 2>(std::array<uint8_t, 2>{0x34, 0x12})) == 0x1234);
static_assert(wire::byteswap<uint64_t>(0x0102030405060708) == 0x0807060504030201);
static_assert(wire::byteswap<uint8_t>(0xab) == 0xab);

std::vector<uint8_t> encoded(auto value) {
  ByteWriter w;
  w.put(value);
  return w.take();
}

TEST(Wire, IntegersAreLittleEndianBytes) {
  EXPECT_THAT(encoded(uint8_t{0xab}), ElementsAre(0xab));
  EXPECT_THAT(encoded(uint16_t{0x1234}), ElementsAre(0x34, 0x12));
  EXPECT_THAT(encoded(uint32_t{0x01020304}), ElementsAre(0x04, 0x03, 0x02, 0x01));
  EXPECT_THAT(encoded(uint64_t{0x0102030405060708}), ElementsAre(0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01));
  EXPECT_THAT(encoded(int16_t{-2}), ElementsAre(0xfe, 0xff));
  EXPECT_THAT(encoded(int32_t{-0x01020304}), ElementsAre(0xfc, 0xfc, 0xfd, 0xfe));
  EXPECT_THAT(encoded(int64_t{INT64_MIN}), ElementsAre(0, 0, 0, 0, 0, 0, 0, 0x80));
}

TEST(Wire, FloatsAreTheLittleEndianBytesOfTheirBits) {
  EXPECT_THAT(encoded(1.0f), ElementsAre(0x00, 0x00, 0x80, 0x3f));
  EXPECT_THAT(encoded(-2.5f), ElementsAre(0x00, 0x00, 0x20, 0xc0));
  EXPECT_THAT(encoded(1.0), ElementsAre(0, 0, 0, 0, 0, 0, 0xf0, 0x3f));
  EXPECT_THAT(encoded(-0.0), ElementsAre(0, 0, 0, 0, 0, 0, 0, 0x80));
}

TEST(Wire, LengthPrefixesAreLittleEndianOfTheirWidth) {
  ByteWriter w;
  w.put_string("ab");
  w.put_string<uint32_t>("cd");
  w.put_bytes<uint16_t>(std::vector<uint8_t>{9});
  w.put_raw("RF");
  EXPECT_THAT(w.take(), ElementsAre(2, 0, 0, 0, 0, 0, 0, 0, 'a', 'b', 2, 0, 0, 0, 'c', 'd', 1, 0, 9, 'R', 'F'));
}

TEST(Wire, ReadsExplicitLittleEndianBytes) {
  const std::vector<uint8_t> bytes = {0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02,
                                      0x01, 0xfe, 0xff, 0x00, 0x00, 0x80, 0x3f};
  ByteReader r(bytes, "test bytes");
  EXPECT_EQ(r.get<uint64_t>("a"), 0x0102030405060708u);
  EXPECT_EQ(r.get<int16_t>("b"), -2);
  EXPECT_EQ(r.get<float>("c"), 1.0f);
  r.expect_end();
}

TEST(Wire, EveryValueRoundTrips) {
  const float nan_bits = std::bit_cast<float>(uint32_t{0x7fc01234});
  std::array<uint8_t, 5> id{1, 2, 3, 4, 5};
  ByteWriter w;
  w.put<uint8_t>(0);
  w.put<uint8_t>(255);
  w.put<int8_t>(-128);
  w.put<uint16_t>(65535);
  w.put<int16_t>(INT16_MIN);
  w.put<uint32_t>(UINT32_MAX);
  w.put<int32_t>(INT32_MIN);
  w.put<uint64_t>(UINT64_MAX);
  w.put<int64_t>(INT64_MIN);
  w.put<int64_t>(-1);
  w.put<float>(nan_bits);
  w.put<float>(std::numeric_limits<float>::denorm_min());
  w.put<double>(-std::numeric_limits<double>::infinity());
  w.put<double>(3.141592653589793);
  w.put_raw(id);
  w.put_string("");
  w.put_string<uint32_t>("a name");
  w.put_bytes(std::vector<uint8_t>(300, 7));
  const auto bytes = w.take();

  ByteReader r(bytes, "round trip");
  EXPECT_EQ(r.get<uint8_t>("u8"), 0);
  EXPECT_EQ(r.get<uint8_t>("u8"), 255);
  EXPECT_EQ(r.get<int8_t>("i8"), -128);
  EXPECT_EQ(r.get<uint16_t>("u16"), 65535);
  EXPECT_EQ(r.get<int16_t>("i16"), INT16_MIN);
  EXPECT_EQ(r.get<uint32_t>("u32"), UINT32_MAX);
  EXPECT_EQ(r.get<int32_t>("i32"), INT32_MIN);
  EXPECT_EQ(r.get<uint64_t>("u64"), UINT64_MAX);
  EXPECT_EQ(r.get<int64_t>("i64"), INT64_MIN);
  EXPECT_EQ(r.get<int64_t>("i64"), -1);
  EXPECT_EQ(std::bit_cast<uint32_t>(r.get<float>("nan")), 0x7fc01234u);  // the payload survives
  EXPECT_EQ(r.get<float>("denormal"), std::numeric_limits<float>::denorm_min());
  EXPECT_EQ(r.get<double>("inf"), -std::numeric_limits<double>::infinity());
  EXPECT_EQ(r.get<double>("pi"), 3.141592653589793);
  std::array<uint8_t, 5> back{};
  r.get_raw(back, "id");
  EXPECT_EQ(back, id);
  EXPECT_EQ(r.get_string("empty"), "");
  EXPECT_EQ(r.get_string<uint32_t>("name"), "a name");
  EXPECT_EQ(r.get_bytes("bytes").size(), 300u);
  EXPECT_EQ(r.remaining(), 0u);
  r.expect_end();
}

TEST(Wire, EveryTruncationIsAProtocolErrorNamingWhatAndTheField) {
  ByteWriter w;
  w.put<uint32_t>(7);
  w.put_string<uint32_t>("name");
  w.put<double>(1.5);
  const auto bytes = w.take();
  for (size_t keep = 0; keep < bytes.size(); ++keep) {
    std::span<const uint8_t> cut(bytes.data(), keep);
    const std::string message = error_of(ErrorKind::kProtocol, [&] {
      ByteReader r(cut, "test message from peer 3");
      r.get<uint32_t>("count");
      r.get_string<uint32_t>("label");
      r.get<double>("weight");
    });
    EXPECT_THAT(message, AllOf(HasSubstr("malformed test message from peer 3"), HasSubstr("truncated at field")))
        << keep;
  }
  EXPECT_THAT(error_of(ErrorKind::kProtocol,
                       [&] {
                         ByteReader r(std::span<const uint8_t>(bytes.data(), 6), "x");
                         r.get<uint32_t>("count");
                         r.get_string<uint32_t>("label");
                       }),
              HasSubstr("field 'label' (needs 4 bytes, 2 left)"));
}

TEST(Wire, TrailingBytesMagicsAndCountsAreChecked) {
  const std::vector<uint8_t> bytes = {'R', 'F', 'X', 'Y', 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x0f, 1};
  EXPECT_THAT(error_of(ErrorKind::kProtocol,
                       [&] {
                         ByteReader r(bytes, "blob of rank 1");
                         r.expect_magic("RFXZ");
                       }),
              AllOf(HasSubstr("blob of rank 1"), HasSubstr("magic 'RFXZ'")));
  EXPECT_THAT(error_of(ErrorKind::kProtocol,
                       [&] {
                         ByteReader r(bytes, "blob of rank 1");
                         r.expect_magic("RFXY");
                         r.get_count("tensors", 1);  // 2^60 items cannot fit in 1 byte
                       }),
              AllOf(HasSubstr("blob of rank 1"), HasSubstr("tensors count")));
  EXPECT_THAT(error_of(ErrorKind::kProtocol,
                       [&] {
                         ByteReader r(bytes, "blob of rank 1");
                         r.expect_magic("RFXY");
                         r.get<uint64_t>("n");
                         r.expect_end();
                       }),
              AllOf(HasSubstr("blob of rank 1"), HasSubstr("1 trailing bytes")));
  // A length that does not fit its prefix is the encoder's caller's error, not a silent truncation.
  EXPECT_THAT(error_of(ErrorKind::kInvalidArgument,
                       [&] {
                         ByteWriter w;
                         w.put_bytes<uint8_t>(std::vector<uint8_t>(256));
                       }),
              HasSubstr("256 bytes"));
}

// A format of every kind of field a list may hold.
enum class Colour : uint8_t { kRed, kGreen, kBlue };
struct Sample {
  uint32_t seq = 0;
  int64_t offset = 0;
  Colour colour = Colour::kRed;
  uint8_t level = 0;  // 0..3
  bool last = false;
  std::string name;
  std::vector<uint8_t> key;
  std::array<uint8_t, 4> id{};
  std::optional<uint64_t> replay_of;
  std::vector<std::pair<uint32_t, int64_t>> pairs;
};

template <typename Io, typename M>
void sample_fields(Io& io, M& m) {
  io(m.seq, "seq");
  io(m.offset, "offset");
  io(m.colour, "colour", Colour::kBlue);
  io(m.level, "level", uint8_t{0}, uint8_t{3});
  io(m.last, "last");
  io(m.name, "name");
  io(m.key, "key");
  io(m.id, "id");
  io(m.replay_of, "replay of");
  io.template items<uint32_t>(
      m.pairs, "pairs", 4 + 8,
      [&](auto& p) {
        io(p.first, "pair rank");
        io(p.second, "pair value");
      },
      3);
}

std::vector<uint8_t> put_sample(const Sample& m) {
  ByteWriter w;
  wire::Put put{w};
  sample_fields(put, m);
  return w.take();
}

Sample get_sample(std::span<const uint8_t> bytes) {
  ByteReader r(bytes, "sample from rank 2");
  wire::Get get{r};
  Sample m;
  sample_fields(get, m);
  r.expect_end();
  return m;
}

TEST(WireFields, AListWritesTheCodecsBytesAndReadsThemBack) {
  Sample m;
  m.seq = 9;
  m.offset = -5;
  m.colour = Colour::kBlue;
  m.level = 3;
  m.last = true;
  m.name = "w";
  m.key = {7, 8};
  m.id = {1, 2, 3, 4};
  m.replay_of = 11;
  m.pairs = {{1, -1}, {2, 2}};
  ByteWriter w;  // the same fields through the codec's own calls
  w.put<uint32_t>(9);
  w.put<int64_t>(-5);
  w.put<uint8_t>(2);
  w.put<uint8_t>(3);
  w.put<uint8_t>(1);
  w.put_string("w");
  w.put_bytes(std::vector<uint8_t>{7, 8});
  w.put_bytes(std::vector<uint8_t>{1, 2, 3, 4});
  w.put<uint8_t>(1);
  w.put<uint64_t>(11);
  w.put<uint32_t>(2);
  w.put<uint32_t>(1);
  w.put<int64_t>(-1);
  w.put<uint32_t>(2);
  w.put<int64_t>(2);
  const std::vector<uint8_t> bytes = put_sample(m);
  EXPECT_EQ(bytes, w.take());
  const Sample back = get_sample(bytes);
  EXPECT_EQ(back.seq, 9u);
  EXPECT_EQ(back.offset, -5);
  EXPECT_EQ(back.colour, Colour::kBlue);
  EXPECT_EQ(back.level, 3);
  EXPECT_TRUE(back.last);
  EXPECT_EQ(back.name, "w");
  EXPECT_THAT(back.key, ElementsAre(7, 8));
  EXPECT_THAT(back.id, ElementsAre(1, 2, 3, 4));
  EXPECT_EQ(back.replay_of, std::optional<uint64_t>(11));
  ASSERT_EQ(back.pairs.size(), 2u);
  EXPECT_EQ(back.pairs[1], std::make_pair(2u, int64_t{2}));

  m.replay_of.reset();  // absent: a zero flag and a zero value
  EXPECT_FALSE(get_sample(put_sample(m)).replay_of.has_value());
}

TEST(WireFields, EveryBoundIsCheckedAsItIsReadNamingTheField) {
  Sample m;
  m.pairs = {{1, 1}};
  const std::vector<uint8_t> good = put_sample(m);
  // Offsets of the bounded fields in `good`: seq 4, offset 8, then colour, level, last.
  auto with = [&](size_t at, uint8_t value) {
    std::vector<uint8_t> bad = good;
    bad[at] = value;
    return bad;
  };
  auto refused = [&](const std::vector<uint8_t>& bytes) {
    return error_of(ErrorKind::kProtocol, [&] { get_sample(bytes); });
  };
  EXPECT_THAT(refused(with(12, 3)), AllOf(HasSubstr("malformed sample from rank 2"), HasSubstr("colour = 3")));
  EXPECT_THAT(refused(with(13, 4)), HasSubstr("level = 4 (not in [0, 3])"));
  EXPECT_THAT(refused(with(14, 2)), HasSubstr("last = 2"));
  Sample wrong_id = m;
  std::vector<uint8_t> bytes = put_sample(wrong_id);
  // The id's length (8 bytes after the name and the key, each an 8-byte length here).
  const size_t id_length = 15 + 8 + 8;
  bytes[id_length] = 3;
  EXPECT_THAT(refused(bytes), HasSubstr("id of 3 bytes, not 4"));
  Sample many = m;
  many.pairs.assign(4, {1, 1});
  EXPECT_THAT(refused(put_sample(many)), HasSubstr("pairs 4 (at most 3)"));
  for (size_t keep = 0; keep < good.size(); ++keep)
    EXPECT_THAT(refused(std::vector<uint8_t>(good.begin(), good.begin() + keep)),
                AnyOf(HasSubstr("truncated at field"), HasSubstr("pairs count 1 exceeds the message size")))
        << keep;
}

}  // namespace
}  // namespace refit
