// The destination's receive path on a stream of hostile control messages: decode_message,
// validate against the bucket size (on a link that maps source memory), then TensorAssembler::add_bucket over a heap
// buffer of exactly used_bytes and one of exactly each source region's length for entries sent in place (so
// AddressSanitizer flags any read outside them), then every byte of every tensor handed out is read, as a loader would.
// On is_last, finish() and reset() start the next refit, as run_receive does; any error ends the refit the same way. As
// the fetch thread does, buckets must come in order (0, 1, ...), a replayed manifest comes from the ManifestCache of
// the buckets that arrived, and a replay of the refit before, when that refit went through, is assembled as repeating
// checked manifests. The harness numbers its refits 1, 2, ... (the link reader drops messages of other refits), so a
// replay names one of those.
//
// Input: byte 0 picks the bucket size; then frames of [u16 little-endian length][message].
// Oracles: errors are Error(kProtocol), or Error(kTransport) when a split tensor's merge
// buffer cannot be allocated; a whole tensor's view lies inside its bucket or region; a merged tensor is
// no larger than the chunks received for it and, when every chunk was a byte range of the
// tensor itself (no box), holds exactly their bytes; no tensor is handed out twice in one refit.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "core/fail.h"
#include "engine/assembler.h"
#include "engine/manifest_cache.h"
#include "engine/protocol.h"
#include "fuzz_common.h"

using namespace refit;

namespace {

constexpr uint64_t kBucketSizes[] = {1, 2, 8, 64, 256, 4096, 65536};
const std::string kWho = "source rank 0";

struct Chunk {
  uint64_t tensor_offset;
  std::vector<std::byte> bytes;
  bool boxed;  // lands where its box says, not at tensor_offset
};

class Harness {
 public:
  explicit Harness(uint64_t bucket_bytes) : bucket_bytes_(bucket_bytes) {}

  void frame(std::span<const uint8_t> bytes) {
    try {
      step(bytes);
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kTransport) FUZZ_EXPECT_PROTOCOL_ERROR(e);
      new_refit(false);  // the refit failed; the next one starts afresh
    }
  }

 private:
  void new_refit(bool went_through) {
    assembler_.reset();
    pending_.clear();
    handed_out_.clear();
    checked_refit_ = went_through ? std::optional<uint64_t>(refit_) : std::nullopt;
    ++refit_;
    next_seq_ = 0;
  }

  void step(std::span<const uint8_t> bytes) {
    protocol::Message msg = protocol::decode_message(bytes, kWho);
    if (msg.type != protocol::MessageType::kBucketReady) {
      new_refit(false);  // the link reader fails on anything but the bucket it waits for
      return;
    }
    protocol::BucketReady& bucket = msg.ready;
    if (bucket.seq != next_seq_) fail(ErrorKind::kProtocol, "bucket {} instead of bucket {}", bucket.seq, next_seq_);
    ++next_seq_;
    // A link that maps the source's memory: entries in place are loaded from their regions.
    protocol::validate(bucket, bucket_bytes_, 2 * bucket_bytes_, SourceAccess::kMap, kWho);
    cache_.take(refit_, bucket, kWho);
    const bool repeats_checked = bucket.replay_of && bucket.replay_of == checked_refit_;

    // Exactly the used bytes and each region's, on the heap: one byte more or less read is an
    // ASan report. Regions as large as the bucket at most (the fuzzer's memory is bounded).
    uint64_t region_bytes = 0;
    for (const auto& r : bucket.regions()) region_bytes += std::min<uint64_t>(r.remote.length, 1ull << 40);
    if (region_bytes > 1u << 20) return new_refit(false);
    std::vector<std::unique_ptr<std::byte[]>> memory;
    std::vector<std::pair<const std::byte*, const std::byte*>> ranges;  // [begin, end) of bucket, regions
    std::vector<const std::byte*> bases;
    auto add = [&](uint64_t n) {
      memory.emplace_back(new std::byte[n]);
      for (uint64_t i = 0; i < n; ++i) memory.back()[i] = static_cast<std::byte>(fill_++ * 131 + 7);
      ranges.emplace_back(memory.back().get(), memory.back().get() + n);
      bases.push_back(memory.back().get());
    };
    add(bucket.used_bytes);
    for (const auto& r : bucket.regions()) add(r.remote.length);

    const protocol::BucketBytes where{bases[0], {bases.begin() + 1, bases.end()}};

    // What a merged tensor must hold: the bytes of the chunks of split tensors, as sent.
    for (const auto& e : bucket.entries()) {
      if (e.box.is_whole() && e.tensor_offset == 0 && e.size == e.tensor.nbytes()) continue;
      const std::byte* p = where.at(e);
      pending_[e.tensor.name].push_back({e.tensor_offset, std::vector<std::byte>(p, p + e.size), !e.box.is_whole()});
    }

    auto views = assembler_.add_bucket(bucket, where, kWho, deadline_after(std::chrono::seconds(10)), repeats_checked);
    for (const TensorView& v : views) {
      FUZZ_CHECK(v.info != nullptr);
      FUZZ_CHECK(handed_out_.insert(v.info->name).second);
      const uint64_t n = v.info->nbytes();
      auto holder = std::find_if(ranges.begin(), ranges.end(),
                                 [&](const auto& r) { return v.data >= r.first && v.data <= r.second; });
      if (holder != ranges.end()) {
        FUZZ_CHECK(n <= static_cast<uint64_t>(holder->second - v.data));
      } else {
        check_merged(v, n);
      }
      read_all(v.data, n);
    }
    if (bucket.is_last) {
      assembler_.finish(kWho);
      new_refit(true);
    }
  }

  void check_merged(const TensorView& v, uint64_t n) {
    auto it = pending_.find(v.info->name);
    FUZZ_CHECK(it != pending_.end());
    uint64_t received = 0;
    for (const auto& c : it->second) received += c.bytes.size();
    FUZZ_CHECK(n <= received);  // bounded by what was fed, before anything is allocated for it
    const bool boxed = std::any_of(it->second.begin(), it->second.end(), [](const Chunk& c) { return c.boxed; });
    std::vector<std::byte> expected(n);
    for (const auto& c : it->second) {
      if (boxed) break;
      FUZZ_CHECK(c.tensor_offset <= n && c.bytes.size() <= n - c.tensor_offset);
      if (!c.bytes.empty()) std::memcpy(expected.data() + c.tensor_offset, c.bytes.data(), c.bytes.size());
    }
    FUZZ_CHECK(boxed || n == 0 || std::memcmp(v.data, expected.data(), n) == 0);
    pending_.erase(it);
  }

  void read_all(const std::byte* p, uint64_t n) {
    uint64_t sum = 0;
    for (uint64_t i = 0; i < n; ++i) sum += static_cast<uint8_t>(p[i]);
    sink_ = sink_ + sum;
  }

  uint64_t bucket_bytes_;
  TensorAssembler assembler_;
  ManifestCache cache_;
  uint64_t refit_ = 1;                     // this harness's refit number
  uint64_t next_seq_ = 0;                  // the bucket the link reader waits for
  std::optional<uint64_t> checked_refit_;  // the refit before, if it went through
  std::set<std::string> handed_out_;       // this refit's tensors
  std::map<std::string, std::vector<Chunk>> pending_;
  uint8_t fill_ = 0;
  volatile uint64_t sink_ = 0;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  Harness h(kBucketSizes[data[0] % std::size(kBucketSizes)]);
  size_t pos = 1;
  while (pos + 2 <= size) {
    size_t n = data[pos] | (size_t{data[pos + 1]} << 8);
    pos += 2;
    if (n > size - pos) n = size - pos;
    h.frame({data + pos, n});
    pos += n;
  }
  return 0;
}
