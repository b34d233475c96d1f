// protocol::decode_message on arbitrary bytes, as the destination's link reader decodes what
// its source sends; a BucketReady is then validated against several bucket sizes, as
// LinkReader does before it reads anything.
// Oracles: only Error(kProtocol) may come out; an accepted message re-encodes to bytes that
// decode to the same encoding;
// a manifest that validate() accepts really lies inside the bucket's used bytes and inside each
// tensor (checked here in 128-bit arithmetic), and TensorInfo::nbytes() (unchecked, used by the
// assembler) agrees with the exact size.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "engine/protocol.h"
#include "fuzz_common.h"

using namespace refit;
using u128 = unsigned __int128;

namespace {

constexpr uint64_t kBucketSizes[] = {0, 1, 8, 64, 4096, uint64_t{1} << 20, uint64_t{1} << 32, UINT64_MAX};

// dtype size x shape, or 0 with *overflow set when it exceeds 64 bits.
u128 exact_nbytes(const TensorInfo& t, bool* overflow) {
  u128 n = dtype_size(t.dtype);
  *overflow = false;
  for (int64_t d : t.shape) {
    FUZZ_CHECK(d >= 0);
    n *= static_cast<uint64_t>(d);
    if (n > UINT64_MAX) {
      *overflow = true;
      n = UINT64_MAX;  // keeps the product bounded; a later 0 dimension is still "too big" for validate
    }
  }
  return n;
}

void check_validated(const protocol::BucketReady& m, uint64_t bucket_bytes) {
  FUZZ_CHECK(u128{m.offset} + m.used_bytes <= 2 * u128{bucket_bytes});
  FUZZ_CHECK(m.used_bytes <= bucket_bytes);
  FUZZ_CHECK(m.replay_of.has_value() == (m.manifest == nullptr));  // a replay's manifest is not on the wire
  if (!m.manifest) return;
  for (const auto& e : m.entries()) {
    bool overflow = false;
    const u128 nbytes = exact_nbytes(e.tensor, &overflow);
    FUZZ_CHECK(!overflow);
    FUZZ_CHECK(e.tensor.nbytes() == static_cast<uint64_t>(nbytes));
    // The chunk lies in its piece, a box inside the tensor.
    u128 piece = dtype_size(e.tensor.dtype);
    for (int64_t d : e.box.shape_in(e.tensor.shape)) {
      FUZZ_CHECK(d >= 0);
      piece *= static_cast<uint64_t>(d);
    }
    for (int c = 0; c < e.box.count; ++c) {
      const Slice& cut = e.box.cuts[c];
      FUZZ_CHECK(cut.dim >= 0 && cut.dim < static_cast<int32_t>(e.tensor.shape.size()));
      FUZZ_CHECK(cut.start >= 0 && cut.length >= 0 && cut.start + cut.length <= e.tensor.shape[cut.dim]);
    }
    FUZZ_CHECK(piece <= nbytes);
    FUZZ_CHECK(u128{e.tensor_offset} + e.size <= piece);
    // ... and in the bucket's used bytes, or in the source region it names.
    FUZZ_CHECK(e.region <= m.regions().size());
    const u128 limit = e.region == 0 ? m.used_bytes : m.regions()[e.region - 1].remote.length;
    FUZZ_CHECK(u128{e.bucket_offset} + e.size <= limit);
  }
  // Spans are ordered, inside the used bytes; each reads from its region or, region 0, from the
  // same offset of the bucket's buffer. Entries of a bucket of spans are all in the bucket.
  u128 end = 0;
  for (const auto& span : m.spans()) {
    FUZZ_CHECK(span.bucket_offset >= end);
    end = u128{span.bucket_offset} + span.size;
    FUZZ_CHECK(end <= m.used_bytes);
    FUZZ_CHECK(span.region <= m.regions().size());
    if (span.region == 0)
      FUZZ_CHECK(span.source_offset == span.bucket_offset);
    else
      FUZZ_CHECK(u128{span.source_offset} + span.size <= m.regions()[span.region - 1].remote.length);
  }
  if (!m.spans().empty())
    FUZZ_CHECK(std::all_of(m.entries().begin(), m.entries().end(), [](const auto& e) { return e.region == 0; }));
  for (size_t k = 0; k < m.regions().size(); ++k)  // every region is used
    FUZZ_CHECK(std::any_of(m.entries().begin(), m.entries().end(), [&](const auto& e) { return e.region == k + 1; }) ||
               std::any_of(m.spans().begin(), m.spans().end(), [&](const auto& s) { return s.region == k + 1; }));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> in(data, size);
  protocol::Message msg;
  try {
    msg = protocol::decode_message(in, "source rank 0");
  } catch (const Error& e) {
    FUZZ_EXPECT_PROTOCOL_ERROR(e);
    return 0;
  }
  Bytes again;
  switch (msg.type) {
    case protocol::MessageType::kBucketReady:
      again = protocol::encode(msg.ready);
      break;
    case protocol::MessageType::kBucketDone:
      again = protocol::encode(msg.done);
      break;
    case protocol::MessageType::kAbort:
      again = protocol::encode(msg.abort);
      break;
    default:
      FUZZ_CHECK(!"decode_message returned an unknown type");
  }
  FUZZ_CHECK(again.size() == size);  // every field has a fixed or length-prefixed size
  try {
    protocol::Message twice = protocol::decode_message(again, "re-encoded message");
    FUZZ_CHECK(twice.type == msg.type);
    if (msg.type == protocol::MessageType::kBucketReady) FUZZ_CHECK(protocol::encode(twice.ready) == again);
  } catch (const Error& e) {
    std::fprintf(stderr, "fuzz: a re-encoded message does not decode: %s\n", e.what());
    std::abort();
  }
  if (msg.type != protocol::MessageType::kBucketReady) return 0;
  for (uint64_t bucket_bytes : kBucketSizes) {
    try {
      protocol::validate(msg.ready, bucket_bytes, 2 * bucket_bytes, "source rank 0");
    } catch (const Error& e) {
      FUZZ_EXPECT_PROTOCOL_ERROR(e);
      continue;
    }
    check_validated(msg.ready, bucket_bytes);
  }
  return 0;
}
