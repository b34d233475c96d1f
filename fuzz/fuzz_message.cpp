// protocol::decode_message on arbitrary bytes, as the destination's link reader decodes what
// its source sends; a BucketReady is then validated against several bucket sizes, as
// LinkReader does before it reads anything.
// Oracles: only Error(kProtocol) may come out; an accepted message re-encodes to bytes that
// decode to the same encoding;
// a manifest that validate() accepts (for each way a link takes source memory) really lies inside
// the bucket's used bytes, its source regions and each tensor (checked here in 128-bit
// arithmetic), TensorInfo::nbytes() (unchecked, used by the assembler) agrees with the exact
// size, and the reads bucket_reads() makes of it stay inside the bucket and its regions and bring
// every byte of every entry the link does not map.
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

void check_reads(const protocol::BucketReady& m, SourceAccess access) {
  const auto reads = protocol::bucket_reads(*m.manifest, access);
  u128 end = 0;
  for (const auto& read : reads) {
    FUZZ_CHECK(read.bucket_offset >= end);  // no two reads land on one byte
    end = u128{read.bucket_offset} + read.size;
    FUZZ_CHECK(end <= m.used_bytes);
    FUZZ_CHECK(read.region <= m.regions().size());
    if (read.region == 0)
      FUZZ_CHECK(read.source_offset == read.bucket_offset);
    else
      FUZZ_CHECK(u128{read.source_offset} + read.size <= m.regions()[read.region - 1].remote.length);
  }
  for (const auto& e : m.entries()) {
    if (e.size == 0 || (e.region > 0 && access == SourceAccess::kMap)) continue;
    const uint64_t from = e.region == 0 ? e.bucket_offset : e.source_offset;
    FUZZ_CHECK(std::any_of(reads.begin(), reads.end(), [&](const auto& read) {
      return read.region == e.region && e.bucket_offset >= read.bucket_offset &&
             u128{e.bucket_offset} + e.size <= u128{read.bucket_offset} + read.size &&
             from - read.source_offset == e.bucket_offset - read.bucket_offset;
    }));
  }
}

void check_validated(const protocol::BucketReady& m, uint64_t bucket_bytes, SourceAccess access) {
  FUZZ_CHECK(u128{m.offset} + m.used_bytes <= 2 * u128{bucket_bytes});
  FUZZ_CHECK(m.used_bytes <= bucket_bytes);
  FUZZ_CHECK(m.replay_of.has_value() == (m.manifest == nullptr));  // a replay's manifest is not on the wire
  if (!m.manifest) return;
  u128 read_end = 0;
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
    // ... in the source region it names, only on a link that takes source memory ...
    FUZZ_CHECK(e.region <= m.regions().size());
    if (e.region > 0) {
      FUZZ_CHECK(access != SourceAccess::kNone);
      FUZZ_CHECK(u128{e.source_offset} + e.size <= m.regions()[e.region - 1].remote.length);
    }
    // ... and in the bucket's used bytes where it lands in the bucket (mapped in place: not at all).
    if (e.region == 0 || access == SourceAccess::kRead)
      FUZZ_CHECK(u128{e.bucket_offset} + e.size <= m.used_bytes);
    else
      FUZZ_CHECK(e.bucket_offset == 0);
    if ((e.region == 0 || access == SourceAccess::kRead) && e.size > 0) {
      FUZZ_CHECK(e.bucket_offset >= read_end);
      read_end = u128{e.bucket_offset} + e.size;
    }
  }
  for (size_t k = 0; k < m.regions().size(); ++k)  // every region is used
    FUZZ_CHECK(std::any_of(m.entries().begin(), m.entries().end(), [&](const auto& e) { return e.region == k + 1; }));
  check_reads(m, access);
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
  // A message concerns its own refit; a later one of its connection only if it is a farewell.
  FUZZ_CHECK(protocol::concerns(msg, msg.refit(), msg.refit() - 1));
  const bool farewell = msg.type == protocol::MessageType::kAbort && msg.abort.farewell;
  FUZZ_CHECK(protocol::concerns(msg, msg.refit() + 1, msg.refit()) == farewell);
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
    for (auto access : {SourceAccess::kNone, SourceAccess::kMap, SourceAccess::kRead}) {
      try {
        protocol::validate(msg.ready, bucket_bytes, 2 * bucket_bytes, access, "source rank 0");
      } catch (const Error& e) {
        FUZZ_EXPECT_PROTOCOL_ERROR(e);
        continue;
      }
      check_validated(msg.ready, bucket_bytes, access);
    }
  }
  return 0;
}
