#include "delta/codec.h"

#include <gtest/gtest.h>

#include <cstring>
#include <deque>
#include <functional>
#include <numeric>
#include <optional>
#include <random>

#include "delta/bits.h"
#include "memory/host_copy_pool.h"
#include "refit/error.h"

namespace refit {
namespace {

std::vector<std::byte> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> out(n);
  for (auto& b : out) b = static_cast<std::byte>(rng() & 0xff);
  return out;
}

// Changes `count` distinct elements of `v` (each to a value with at least one bit different).
std::vector<std::byte> changed(std::vector<std::byte> v, size_t element_size, size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  const size_t elements = v.size() / element_size;
  std::vector<size_t> order(elements);
  for (size_t i = 0; i < elements; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  for (size_t k = 0; k < count; ++k) {
    std::byte* e = v.data() + order[k] * element_size;
    e[rng() % element_size] ^= static_cast<std::byte>(1 + rng() % 255);
  }
  return v;
}

struct RoundTrip {
  bool encoded = false;
  std::vector<uint8_t> record;
  DeltaHeader header;
};

// Encodes old -> now, checks the source's base became `now`, applies the record to a copy of
// `old` and checks it became `now`, bit for bit.
RoundTrip round_trip(const std::vector<std::byte>& old, const std::vector<std::byte>& now, size_t element_size) {
  RoundTrip r;
  std::vector<std::byte> base = old;
  const DeltaResult result = encode_delta(base, now, element_size, r.record);
  r.encoded = result.encoded;
  EXPECT_EQ(base, now) << "the base follows the tensor, sent as changes or whole";
  if (!r.encoded) return r;
  EXPECT_EQ(result.checksum, delta_checksum(now));
  std::vector<std::byte> target = old;
  r.header = apply_delta(target, element_size, r.record, "test record");
  EXPECT_EQ(target, now);
  EXPECT_EQ(r.header.checksum, delta_checksum(target));
  return r;
}

TEST(DeltaCodec, SparseChangesTravelAsGapsAndApplyBitExactly) {
  const auto old = random_bytes(2 * 100000, 1);  // 100k bf16 elements
  const auto now = changed(old, 2, 500, 2);      // 0.5% changed
  const RoundTrip r = round_trip(old, now, 2);
  ASSERT_TRUE(r.encoded);
  EXPECT_EQ(r.header.encoding, DeltaEncoding::kGaps);
  EXPECT_EQ(r.header.changed, 500u);
  // Gaps of ~200 elements (1-2 varint bytes each) and values of at most 2 bytes: far below 200 kB.
  EXPECT_LE(r.record.size(), kDeltaHeaderBytes + 500 * (2 + 2));
  EXPECT_GE(r.record.size(), kDeltaHeaderBytes + 500 * (1 + 1));
}

TEST(DeltaCodec, DenseChangesTravelAsABitmap) {
  const auto old = random_bytes(4 * 40000, 3);
  const auto now = changed(old, 4, 20000, 4);  // half of the fp32 elements
  const RoundTrip r = round_trip(old, now, 4);
  ASSERT_TRUE(r.encoded);
  EXPECT_EQ(r.header.encoding, DeltaEncoding::kBitmap);
  EXPECT_LE(r.record.size(), kDeltaHeaderBytes + 40000 / 8 + 20000 * 4);
}

// An optimizer step as bf16 bits see it: most changed weights move by one or two units in the
// last place, up or down; their steps take one byte where the raw value takes two.
TEST(DeltaCodec, SmallStepsTravelAsOneByteSteps) {
  auto old = random_bytes(2 * 50000, 11);
  auto now = old;
  std::mt19937 rng(12);
  size_t changed = 0;
  for (size_t i = 0; i < 50000; i += 40 + rng() % 40) {
    uint16_t v;
    std::memcpy(&v, &now[2 * i], 2);
    v = static_cast<uint16_t>(v + ((rng() & 1) ? 1 : -2));  // wraps at 0 and 0xffff: still exact
    std::memcpy(&now[2 * i], &v, 2);
    ++changed;
  }
  const RoundTrip r = round_trip(old, now, 2);
  ASSERT_TRUE(r.encoded);
  EXPECT_EQ(r.header.values, DeltaValues::kSteps);
  EXPECT_EQ(r.header.changed, changed);
  EXPECT_EQ(r.record.size(), kDeltaHeaderBytes + changed * (1 + 1));  // gaps under 128, steps of 1 byte
}

TEST(DeltaCodec, StepsWrapAroundEveryElementSize) {
  for (size_t element_size : {1, 2, 4, 8}) {
    std::vector<std::byte> old(element_size * 1024, std::byte{0}), now = old;
    // 0 -> all ones (a step of -1), and all ones -> 0 (+1), and the largest steps either way.
    for (size_t k = 0; k < element_size; ++k) now[k] = std::byte{0xff};
    for (size_t k = 0; k < element_size; ++k) old[element_size * 100 + k] = std::byte{0xff};
    now[element_size * 200 + element_size - 1] = std::byte{0x80};  // +2^(bits-1): the most negative
    now[element_size * 300 + element_size - 1] = std::byte{0x7f};  // a large positive step
    const RoundTrip r = round_trip(old, now, element_size);
    ASSERT_TRUE(r.encoded) << element_size;
    EXPECT_EQ(r.header.changed, 4u) << element_size;
  }
}

TEST(DeltaCodec, AlmostEverythingChangedGoesWhole) {
  const auto old = random_bytes(2 * 4096, 5);
  const auto now = changed(old, 2, 4000, 6);
  EXPECT_FALSE(round_trip(old, now, 2).encoded);
}

// A record is never smaller than an empty tensor (found by fuzz_delta: the base's copy of nothing
// must not touch memory).
TEST(DeltaCodec, AnEmptyTensorGoesWhole) {
  std::vector<std::byte> base, now;
  std::vector<uint8_t> out{42};
  EXPECT_FALSE(encode_delta(base, now, 2, out).encoded);
  EXPECT_EQ(out, std::vector<uint8_t>{42});
}

TEST(DeltaCodec, NothingChangedIsTheHeaderAlone) {
  const auto old = random_bytes(8 * 1000, 7);
  const RoundTrip r = round_trip(old, old, 8);
  ASSERT_TRUE(r.encoded);
  EXPECT_EQ(r.header.encoding, DeltaEncoding::kNone);
  EXPECT_EQ(r.record.size(), kDeltaHeaderBytes);
}

TEST(DeltaCodec, ChangesAreBitsNotValues) {
  // -0.0 and 0.0 compare equal as floats, and a NaN never equals itself: both must be changes by
  // bits, and a NaN that stays the same bits is no change.
  std::vector<float> a = {0.0f, 1.0f, std::nanf("1"), 2.0f}, b = {-0.0f, 1.0f, std::nanf("1"), 2.0f};
  std::vector<std::byte> old(16), now(16);
  std::memcpy(old.data(), a.data(), 16);
  std::memcpy(now.data(), b.data(), 16);
  // Too small a tensor to win; a larger one with the same pattern.
  std::vector<std::byte> big_old, big_now;
  for (int i = 0; i < 256; ++i) {
    big_old.insert(big_old.end(), old.begin(), old.end());
    big_now.insert(big_now.end(), (i == 7 ? now : old).begin(), (i == 7 ? now : old).end());
  }
  const RoundTrip r = round_trip(big_old, big_now, 4);
  ASSERT_TRUE(r.encoded);
  EXPECT_EQ(r.header.changed, 1u);  // element 28: +0.0 -> -0.0; the NaNs kept their bits
}

TEST(DeltaCodec, EveryElementSizeAndTheLastElement) {
  for (size_t element_size : {1, 2, 4, 8}) {
    auto old = random_bytes(element_size * 3000, 8);
    auto now = old;
    now[now.size() - 1] ^= std::byte{0x80};  // the last element
    now[0] ^= std::byte{0x01};               // and the first
    const RoundTrip r = round_trip(old, now, element_size);
    ASSERT_TRUE(r.encoded) << element_size;
    EXPECT_EQ(r.header.changed, 2u);
  }
}

TEST(DeltaCodec, AGapOfManyVarintBytesRoundTrips) {
  // Two changes 2^21 + 6 elements apart: a gap of 22 bits, a four-byte varint.
  const size_t elements = (1u << 21) + 10;
  std::vector<std::byte> old(elements), now(elements);
  now[3] = std::byte{1};
  now[elements - 1] = std::byte{1};
  const RoundTrip r = round_trip(old, now, 1);
  ASSERT_TRUE(r.encoded);
  EXPECT_EQ(r.record.size(), kDeltaHeaderBytes + 1 + 4 + 2);
}

class DeltaCodecBadRecord : public ::testing::Test {
 protected:
  void SetUp() override {
    old_ = random_bytes(2 * 5000, 9);
    now_ = changed(old_, 2, 40, 10);
    std::vector<std::byte> base = old_;
    ASSERT_TRUE(encode_delta(base, now_, 2, record_).encoded);
  }
  // Applies `record` to a copy of the old version; expects kProtocol naming the record and the
  // target left as it was.
  void expect_refused(const std::vector<uint8_t>& record, const std::string& says, size_t element_size = 2) {
    std::vector<std::byte> target = old_;
    try {
      apply_delta(target, element_size, record, "changes to 'w' from source rank 0");
      FAIL() << "applied a bad record";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kProtocol);
      EXPECT_NE(std::string(e.what()).find("'w' from source rank 0"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
    EXPECT_EQ(target, old_) << "a refused record must not write anything";
  }
  std::vector<std::byte> old_, now_;
  std::vector<uint8_t> record_;
};

TEST_F(DeltaCodecBadRecord, TruncatedOrPadded) {
  auto cut = record_;
  cut.resize(20);
  expect_refused(cut, "truncated");
  auto padded = record_;
  padded.push_back(0);
  expect_refused(padded, "bytes");
}

TEST_F(DeltaCodecBadRecord, ForAnotherTensor) {
  expect_refused(record_, "for 5000 elements of 2 bytes", 4);
  auto bad_magic = record_;
  bad_magic[0] = 'X';
  expect_refused(bad_magic, "magic");
}

TEST_F(DeltaCodecBadRecord, PositionOutOfRange) {
  auto bad = record_;
  // The first gap's varint: make it point past the end (0x7f... is the max single byte; set a
  // multi-byte gap too large by rewriting the first position byte with continuation bits).
  bad[kDeltaHeaderBytes] = 0xff;
  bad[kDeltaHeaderBytes + 1] = 0xff;
  bad[kDeltaHeaderBytes + 2] = 0x7f;
  expect_refused(bad, "position");
}

TEST_F(DeltaCodecBadRecord, AStepLargerThanTheElement) {
  // A record of one change whose step (zigzag 2^16) cannot be a 2-byte element's.
  std::vector<std::byte> old(2 * 64, std::byte{0}), now = old;
  now[2] = std::byte{1};
  std::vector<uint8_t> record;
  ASSERT_TRUE(encode_delta(old, now, 2, record).encoded);
  ASSERT_EQ(record.size(), kDeltaHeaderBytes + 1 + 1);
  ASSERT_EQ(record[6], static_cast<uint8_t>(DeltaValues::kSteps));
  record.back() = 0x80;  // the step as 0x80 0x80 0x04 = 2^16
  record.push_back(0x80);
  record.push_back(0x04);
  std::vector<std::byte> target(2 * 64, std::byte{0});
  try {
    apply_delta(target, 2, record, "changes to 'w' from source rank 0");
    FAIL() << "applied a step past the element's range";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("steps by 65536"), std::string::npos) << e.what();
  }
}

TEST_F(DeltaCodecBadRecord, UnknownChecksumKind) {
  auto bad = record_;
  bad[7] = 7;  // the checksum kind
  expect_refused(bad, "unknown checksum kind 7");
}

TEST_F(DeltaCodecBadRecord, MoreChangesThanElements) {
  auto bad = record_;
  bad[16] = 0xff;  // changed count
  bad[17] = 0xff;
  expect_refused(bad, "changed of 5000 elements");
}

// The changes a GPU kernel compacts (indices, bits before and after) make the record the host's
// scan makes of the same tensors, but for the checksum's kind and value.
// A large tensor scanned in parts (in any order, as threads finish them) makes the whole scan's
// record, the word hash in place of xxh3; parts end on words, the last anywhere.
TEST(DeltaCodec, ATensorScannedInPartsMakesTheWholeScansRecordWithTheWordHash) {
  for (size_t element_size : {1, 2, 4, 8}) {
    const size_t bytes = (64 << 10) * 5 + 3 * element_size;  // five parts and a short sixth
    const auto old = random_bytes(bytes, 7);
    const auto now = changed(old, element_size, bytes / element_size / 100, 8);
    std::vector<std::byte> whole_base = old;
    std::vector<uint8_t> whole_record;
    ASSERT_TRUE(encode_delta(whole_base, now, element_size, whole_record).encoded);

    std::vector<std::byte> base = old;
    std::vector<DeltaPart> parts;
    std::vector<DeltaScratch> found(6);
    for (size_t at = 0; at < bytes; at += 64 << 10)
      parts.push_back({at, std::min<size_t>(64 << 10, bytes - at), &found[parts.size()]});
    for (size_t k = parts.size(); k-- > 0;)
      scan_delta_part(std::span(base).subspan(parts[k].first_byte, parts[k].bytes),
                      std::span(now).subspan(parts[k].first_byte, parts[k].bytes), element_size, parts[k]);
    std::vector<uint8_t> record;
    DeltaScratch joined;
    const DeltaResult result = join_delta_parts(base, now, element_size, parts, record, joined);
    ASSERT_TRUE(result.encoded) << element_size;
    EXPECT_EQ(base, now);
    EXPECT_EQ(result.checksum, delta_checksum(now, DeltaChecksum::kWords));
    // The same positions and values; only the checksum's kind and value differ.
    ASSERT_EQ(record.size(), whole_record.size());
    const DeltaHeader h = read_delta_header(record, "parts"), w = read_delta_header(whole_record, "whole");
    EXPECT_EQ(h.checksum_kind, DeltaChecksum::kWords);
    EXPECT_EQ(h.changed, w.changed);
    EXPECT_TRUE(std::equal(record.begin() + kDeltaHeaderBytes, record.end(), whole_record.begin() + kDeltaHeaderBytes));
    std::vector<std::byte> target = old;
    apply_delta(target, element_size, record, "parts");
    EXPECT_EQ(target, now) << element_size;
  }
}

// A part whose changes are too dense for a record sends the tensor whole; the base still becomes
// the tensor. Parts that do not tile the tensor are a bug, not a record.
TEST(DeltaCodec, ADensePartSendsTheTensorWholeAndPartsMustTileIt) {
  const size_t bytes = 4 * (16 << 10);
  const auto old = random_bytes(bytes, 3);
  auto now = changed(old, 1, 100, 4);
  for (size_t i = 0; i < (16 << 10); ++i) now[i] ^= std::byte{0xff};  // all of part 0
  std::vector<std::byte> base = old;
  std::vector<DeltaScratch> found(4);
  std::vector<DeltaPart> parts;
  for (size_t k = 0; k < 4; ++k) parts.push_back({k * (16 << 10), 16 << 10, &found[k]});
  for (auto& part : parts)
    scan_delta_part(std::span(base).subspan(part.first_byte, part.bytes),
                    std::span(now).subspan(part.first_byte, part.bytes), 1, part);
  EXPECT_FALSE(parts[0].fits);
  EXPECT_TRUE(parts[1].fits);
  std::vector<uint8_t> record{1, 2, 3};
  DeltaScratch joined;
  EXPECT_FALSE(join_delta_parts(base, now, 1, parts, record, joined).encoded);
  EXPECT_EQ(base, now);
  EXPECT_EQ(record, (std::vector<uint8_t>{1, 2, 3})) << "left as it was";
  std::vector<DeltaPart> gap{parts[0], parts[2], parts[3]};
  try {
    join_delta_parts(base, now, 1, gap, record, joined);
    FAIL() << "a gap between parts was joined";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInternal);
  }
}

TEST(DeltaCodec, ChangesFoundElsewhereMakeTheHostsRecord) {
  for (size_t element_size : {1, 2, 4, 8}) {
    const size_t elements = 40001;  // not a whole number of words for elements under 8 bytes
    const auto old = random_bytes(elements * element_size, 11);
    for (size_t count : {size_t{0}, size_t{3}, size_t{400}, size_t{9000}}) {
      const auto now = changed(old, element_size, count, 12);
      std::vector<std::byte> base = old;
      std::vector<uint8_t> host;
      ASSERT_TRUE(encode_delta(base, now, element_size, host).encoded);
      std::vector<uint64_t> index, before, after;
      for (size_t i = 0; i < elements; ++i) {
        uint64_t a = 0, b = 0;
        for (size_t k = 0; k < element_size; ++k) {
          a |= static_cast<uint64_t>(old[i * element_size + k]) << (8 * k);
          b |= static_cast<uint64_t>(now[i * element_size + k]) << (8 * k);
        }
        if (a == b) continue;
        index.push_back(i);
        before.push_back(a);
        after.push_back(b);
      }
      const uint64_t checksum = delta_checksum(now, DeltaChecksum::kWords);
      std::vector<uint8_t> made;
      ASSERT_TRUE(
          encode_delta_changes(elements, element_size, index, before, after, DeltaChecksum::kWords, checksum, made));
      ASSERT_EQ(made.size(), host.size()) << element_size << "-byte elements, " << count << " changes";
      const DeltaHeader h = read_delta_header(made, "record");
      EXPECT_EQ(h.checksum_kind, DeltaChecksum::kWords);
      EXPECT_EQ(h.checksum, checksum);
      EXPECT_EQ(read_delta_header(host, "record").checksum_kind, DeltaChecksum::kXxh3);
      for (size_t b = 0; b < made.size(); ++b) {
        if (b == 7 || (b >= 24 && b < 32)) continue;  // checksum kind and value
        ASSERT_EQ(made[b], host[b]) << "byte " << b << ", " << element_size << "-byte elements";
      }
      std::vector<std::byte> target = old;
      apply_delta(target, element_size, made, "record");
      EXPECT_EQ(target, now);
      EXPECT_EQ(delta_checksum(target, h.checksum_kind), h.checksum);
    }
  }
}

// A GPU's compaction of many changes is written in parts on several threads, a batch's tensors
// together: each record is the one-thread record byte for byte, whatever order the parts run in,
// for every way of writing positions and values; a tensor whose record would not be smaller in
// the same batch is left alone.
TEST(DeltaCodec, ChangesFoundElsewhereWrittenInPartsMakeTheSameRecord) {
  HostCopyPool pool(3);
  const DeltaForEach on_pool = [&](size_t n, const std::function<void(size_t)>& body) { pool.for_each(n, body); };
  const DeltaForEach backwards = [](size_t n, const std::function<void(size_t)>& body) {
    for (size_t k = n; k-- > 0;) body(k);
  };
  struct Case {
    uint64_t elements;
    size_t element_size;
    std::vector<uint64_t> index, before, after;
    std::vector<uint8_t> alone;
  };
  std::deque<Case> cases;  // the batch below points into them
  for (size_t element_size : {2, 4}) {
    // every: a change every that many elements on average; steps: by one unit (else random bits).
    for (auto [every, steps] : {std::pair{9u, true}, std::pair{9u, false}, std::pair{3u, true}, std::pair{3u, false},
                                std::pair{300u, true}}) {
      std::mt19937_64 rng(every * 7 + element_size);
      const uint64_t kElements = every * uint64_t{150000} + 7;  // about 150,000 changes: several parts
      std::vector<uint64_t> index, before, after;
      for (uint64_t i = rng() % every; i < kElements; i += 1 + rng() % (2 * every - 1)) {
        const uint64_t mask = element_size == 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * element_size)) - 1;
        const uint64_t old = rng() & mask;
        index.push_back(i);
        before.push_back(old);
        after.push_back(steps ? (old + 1) & mask : (old ^ (1 + rng() % mask)) & mask);
      }
      SCOPED_TRACE(::testing::Message() << element_size << "-byte elements, " << index.size() << " changes, steps "
                                        << steps);
      ASSERT_GT(index.size(), 2 * kDeltaChangesPerPart) << "several parts";
      std::vector<uint8_t> alone, parts, reversed;
      ASSERT_TRUE(encode_delta_changes(kElements, element_size, index, before, after, DeltaChecksum::kWords, 5, alone));
      ASSERT_TRUE(encode_delta_changes(kElements, element_size, index, before, after, DeltaChecksum::kWords, 5, parts,
                                       on_pool));
      ASSERT_TRUE(encode_delta_changes(kElements, element_size, index, before, after, DeltaChecksum::kWords, 5,
                                       reversed, backwards));
      EXPECT_TRUE(parts == alone);
      EXPECT_TRUE(reversed == alone);
      DeltaChanges decoded;
      decode_delta(alone, element_size, kElements * element_size, decoded, "record");
      EXPECT_EQ(decoded.index, index);
      cases.push_back({kElements, element_size, index, before, after, alone});
    }
  }
  // Every case, and a small tensor that changed throughout (no record), in one batch.
  std::vector<uint64_t> all(50), ones(50, 1), twos(50, 2);
  std::iota(all.begin(), all.end(), 0);
  cases.push_back({50, 1, all, ones, twos, {42}});
  std::vector<std::vector<uint8_t>> outs(cases.size(), std::vector<uint8_t>{42});
  std::vector<ChangesToEncode> batch;
  for (size_t k = 0; k < cases.size(); ++k)
    batch.push_back({cases[k].elements, cases[k].element_size, cases[k].index, cases[k].before, cases[k].after,
                     DeltaChecksum::kWords, 5, &outs[k]});
  encode_delta_changes(batch, on_pool);
  for (size_t k = 0; k < cases.size(); ++k) {
    EXPECT_EQ(batch[k].encoded, k + 1 < cases.size()) << k;
    EXPECT_TRUE(outs[k] == cases[k].alone) << k;
  }
}

TEST(DeltaCodec, TooManyChangesFoundElsewhereAreNotARecord) {
  std::vector<uint64_t> index(50), before(50, 1), after(50, 2);
  for (size_t i = 0; i < index.size(); ++i) index[i] = i;
  std::vector<uint8_t> out{42};
  EXPECT_FALSE(encode_delta_changes(50, 1, index, before, after, DeltaChecksum::kWords, 0, out));
  EXPECT_EQ(out, std::vector<uint8_t>{42});
}

// The word hash: every byte and its position count, the length too.
TEST(DeltaCodec, TheWordHashSeesEveryByteAndPosition) {
  const auto bytes = random_bytes(1003, 5);
  const uint64_t h = delta_checksum(bytes, DeltaChecksum::kWords);
  EXPECT_NE(h, delta_checksum(bytes, DeltaChecksum::kXxh3));
  for (size_t at : {size_t{0}, size_t{7}, size_t{8}, size_t{1000}, size_t{1002}}) {
    auto flipped = bytes;
    flipped[at] ^= std::byte{0x10};
    EXPECT_NE(delta_checksum(flipped, DeltaChecksum::kWords), h) << "byte " << at;
  }
  auto swapped = bytes;
  std::swap_ranges(swapped.begin(), swapped.begin() + 8, swapped.begin() + 8);
  EXPECT_NE(delta_checksum(swapped, DeltaChecksum::kWords), h);
  auto longer = bytes;
  longer.push_back(std::byte{0});
  EXPECT_NE(delta_checksum(longer, DeltaChecksum::kWords), h);
  EXPECT_NE(delta_checksum(std::span(bytes).first(1000), DeltaChecksum::kWords),
            delta_checksum(std::span(bytes).first(1001), DeltaChecksum::kWords));
}

// The word hash is a sum over words: hashed in parts (as a destination does on several cores) it is
// the same checksum, whatever the parts and a tail shorter than a word.
TEST(DeltaChecksum, TheWordHashInPartsIsTheWholeOnes) {
  std::vector<std::byte> bytes(8 * 1000 + 5);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::byte>((i * 2654435761u) >> 13);
  const std::span<const std::byte> all(bytes);
  const uint64_t whole = delta_checksum(all, DeltaChecksum::kWords);
  for (size_t part_words : {1, 7, 64, 1000}) {
    uint64_t sum = 0;
    for (size_t w = 0; w * 8 < bytes.size(); w += part_words)
      sum += word_hash_terms(all.subspan(w * 8, std::min(part_words * 8, bytes.size() - w * 8)), w);
    EXPECT_EQ(word_hash::finish(sum, bytes.size()), whole) << part_words << " words a part";
  }
  // A moved part changes it.
  EXPECT_NE(word_hash::finish(word_hash_terms(all.subspan(8), 0) + word_hash_terms(all.first(8), 1000), bytes.size()),
            whole);
}

// The decoder before records were decoded in parts, one varint after the other: the oracle the
// parts must agree with. Nothing when it refuses the record.
std::optional<DeltaChanges> decoded_one_by_one(std::span<const uint8_t> record, size_t element_size) {
  DeltaChanges out;
  try {
    out.header = read_delta_header(record, "record");
  } catch (const Error&) {
    return std::nullopt;
  }
  const DeltaHeader& h = out.header;
  const uint8_t* p = record.data() + kDeltaHeaderBytes;
  const uint8_t* const end = record.data() + record.size();
  if (h.element_size != element_size || h.changed > static_cast<uint64_t>(end - p)) return std::nullopt;
  auto varint = [&](uint64_t* v) {
    *v = 0;
    for (int shift = 0;; shift += 7) {
      if (p >= end || shift > 63) return false;
      const uint8_t byte = *p++;
      *v |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if (!(byte & 0x80)) return true;
    }
  };
  if (h.encoding == DeltaEncoding::kGaps) {
    uint64_t previous = 0;
    for (uint64_t k = 0; k < h.changed; ++k) {
      uint64_t gap = 0;
      if (!varint(&gap)) return std::nullopt;
      const uint64_t i = k == 0 ? gap : previous + 1 + gap;
      if (gap >= h.elements || i >= h.elements || (k > 0 && i <= previous)) return std::nullopt;
      out.index.push_back(previous = i);
    }
  } else if (h.encoding == DeltaEncoding::kBitmap) {
    const uint64_t bitmap_bytes = (h.elements + 7) / 8;
    if (static_cast<uint64_t>(end - p) < bitmap_bytes) return std::nullopt;
    for (uint64_t i = 0; i < h.elements; ++i)
      if (p[i / 8] & (1u << (i % 8))) out.index.push_back(i);
    if ((h.elements % 8 != 0 && (p[bitmap_bytes - 1] >> (h.elements % 8)) != 0) || out.index.size() != h.changed)
      return std::nullopt;
    p += bitmap_bytes;
  }
  for (size_t k = 0; k < out.index.size(); ++k) {
    uint64_t v = 0;
    if (h.values == DeltaValues::kRaw) {
      if (static_cast<uint64_t>(end - p) < element_size) return std::nullopt;
      std::memcpy(&v, p, element_size);
      p += element_size;
    } else if (!varint(&v) || (element_size < 8 && (v >> (8 * element_size)) != 0)) {
      return std::nullopt;
    }
    out.values.push_back(v);
  }
  if (p != end) return std::nullopt;
  return out;
}

// A record of many changes is decoded and applied in parts, on a pool's threads: the changes of
// the decoder one varint after the other, for every encoding of positions and values, and the
// same records refused (each mutated byte of one, at part cuts too). Many records of a batch,
// large and small, decode and apply together as one by one, and one malformed record among them
// leaves every target as it was.
TEST(DeltaCodec, ARecordOfManyChangesDecodesInPartsAsOneByOne) {
  HostCopyPool pool(3);
  const DeltaForEach on_pool = [&](size_t n, const std::function<void(size_t)>& body) { pool.for_each(n, body); };
  constexpr size_t kElements = size_t{2} << 20;  // bf16
  const auto old = random_bytes(2 * kElements, 7);
  // Every `every`-th element stepped by one unit in the last place (steps), or changed at random (raw).
  auto make = [&](size_t every, bool steps) {
    std::vector<std::byte> now = old;
    std::mt19937 rng(static_cast<uint32_t>(every));
    for (size_t i = rng() % every; i < kElements; i += 1 + rng() % (2 * every - 1)) {
      uint16_t v = 0;
      std::memcpy(&v, now.data() + 2 * i, 2);
      v = steps ? static_cast<uint16_t>(v + 1) : static_cast<uint16_t>(v ^ (0x8000 | (rng() & 0x7fff)));
      std::memcpy(now.data() + 2 * i, &v, 2);
    }
    return now;
  };
  struct Case {
    size_t every;
    bool steps;
    DeltaEncoding encoding;
    DeltaValues values;
  };
  std::vector<std::vector<std::byte>> batch_now;
  std::vector<std::vector<uint8_t>> batch_records;
  for (const Case& c : {Case{9, true, DeltaEncoding::kGaps, DeltaValues::kSteps},
                        Case{9, false, DeltaEncoding::kGaps, DeltaValues::kRaw},
                        Case{3, true, DeltaEncoding::kBitmap, DeltaValues::kSteps},
                        Case{3, false, DeltaEncoding::kBitmap, DeltaValues::kRaw},
                        Case{100000, true, DeltaEncoding::kGaps, DeltaValues::kSteps}}) {
    const auto now = make(c.every, c.steps);
    std::vector<std::byte> base = old;
    std::vector<uint8_t> record;
    ASSERT_TRUE(encode_delta(base, now, 2, record).encoded);
    const DeltaHeader h = read_delta_header(record, "record");
    SCOPED_TRACE(::testing::Message() << h.changed << " changes, encoding " << static_cast<int>(h.encoding));
    ASSERT_EQ(h.encoding, c.encoding);
    ASSERT_EQ(h.values, c.values);
    batch_now.push_back(now);
    batch_records.push_back(record);
    if (c.every == 100000) {
      ASSERT_LT(h.changed, 100u) << "a small record beside the large ones";
      continue;
    }
    ASSERT_GT(h.changed, 3u << 16) << "several parts";
    const auto oracle = decoded_one_by_one(record, 2);
    ASSERT_TRUE(oracle.has_value());
    for (const DeltaForEach& runner : {DeltaForEach{}, on_pool}) {
      DeltaChanges parts;
      decode_delta(record, 2, 2 * kElements, parts, "record", runner);
      EXPECT_EQ(parts.index, oracle->index);
      EXPECT_EQ(parts.values, oracle->values);
      std::vector<std::byte> target = old;
      apply_delta(target, 2, record, "record", runner);
      EXPECT_TRUE(target == now);
    }
    // Mutated bytes past the header: refused by both, or the same changes.
    std::mt19937 rng(11);
    int refusals = 0;
    for (int m = 0; m < 40; ++m) {
      std::vector<uint8_t> bad = record;
      const size_t at = kDeltaHeaderBytes + rng() % (bad.size() - kDeltaHeaderBytes);
      bad[at] = static_cast<uint8_t>(rng() % 3 == 0 ? 0x80 | bad[at] : rng() & 0xff);
      if (m % 10 == 9) bad.push_back(static_cast<uint8_t>(rng() & 0xff));
      if (m % 10 == 8) bad.pop_back();
      const auto expected = decoded_one_by_one(bad, 2);
      DeltaChanges got;
      bool refused = false;
      try {
        decode_delta(bad, 2, 2 * kElements, got, "record", on_pool);
      } catch (const Error& e) {
        refused = true;
        EXPECT_EQ(e.kind(), ErrorKind::kProtocol) << e.what();
      }
      EXPECT_EQ(refused, !expected.has_value()) << "mutation " << m << " at byte " << at;
      refusals += refused;
      if (!refused && expected) {
        EXPECT_EQ(got.index, expected->index) << "mutation " << m;
        EXPECT_EQ(got.values, expected->values) << "mutation " << m;
      }
    }
    EXPECT_GT(refusals, 0);
    EXPECT_LT(refusals, 40) << "some mutations make another valid record";
  }
  auto apply_batch = [&](const std::vector<std::vector<uint8_t>>& records,
                         std::vector<std::vector<std::byte>>& targets) {
    std::vector<RecordToApply> batch;
    for (size_t k = 0; k < records.size(); ++k)
      batch.push_back({targets[k], 2, records[k], "record " + std::to_string(k), {}});
    apply_delta(batch, on_pool);
  };
  std::vector<std::vector<std::byte>> targets(batch_records.size(), old);
  apply_batch(batch_records, targets);
  for (size_t k = 0; k < targets.size(); ++k) EXPECT_TRUE(targets[k] == batch_now[k]) << "record " << k;
  // Record 2's bitmap marks one element more than its header says: refused, nothing written.
  std::vector<std::vector<uint8_t>> with_bad = batch_records;
  const uint8_t* bitmap = with_bad[2].data() + kDeltaHeaderBytes;
  size_t clear_byte = 0;
  while (bitmap[clear_byte] == 0xff) ++clear_byte;
  with_bad[2][kDeltaHeaderBytes + clear_byte] = 0xff;
  ASSERT_FALSE(decoded_one_by_one(with_bad[2], 2).has_value());
  targets.assign(batch_records.size(), old);
  try {
    apply_batch(with_bad, targets);
    ADD_FAILURE() << "a batch with a malformed record was applied";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kProtocol) << e.what();
    EXPECT_NE(std::string(e.what()).find("record 2"), std::string::npos) << e.what();
  }
  for (size_t k = 0; k < targets.size(); ++k) EXPECT_TRUE(targets[k] == old) << "record " << k << " was written";
}

}  // namespace
}  // namespace refit
