// The delta of one tensor between two versions: which elements changed and their new values,
// compared and written as bits (nothing is added or subtracted, so applying a delta to the old
// version gives the new one bit for bit; -0.0 vs 0.0 or two NaN payloads count as changes).
//
// A record is self-describing: a fixed header (magic "RFD1", position encoding, element size,
// value coding, checksum kind, element count, changed count, checksum of the whole tensor after
// the change: xxh3-64 for a tensor in host memory scanned whole, the word hash of delta/bits.h
// for one a kernel hashed in GPU memory, whose blocks hash their words independently, or one
// scanned in parts on several threads), then
// the positions and the new values, each written whichever way is smaller:
//   positions: gaps   each changed index as the LEB128 varint of its distance from the previous
//                     one (about 1 byte per change when more than ~1% of the elements changed);
//              bitmap one bit per element (denser changes);
//              none   nothing changed (the header alone);
//   values:    raw    the new element bytes, in index order;
//              steps  the difference of the new and old bit patterns (the elements' bytes as
//                     little-endian integers, modulo 2^bits), zigzagged and LEB128-coded: an
//                     optimizer step moves most bf16 weights by a few units in the last place,
//                     one byte instead of two. Integer arithmetic on bits: still exact.
// apply_delta() checks every field before it writes anything, so a malformed record is
// Error(kProtocol) naming it, never a stray write.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace refit {

class HostCopyPool;

enum class DeltaEncoding : uint8_t { kNone = 0, kGaps = 1, kBitmap = 2 };
enum class DeltaValues : uint8_t { kRaw = 0, kSteps = 1 };
enum class DeltaChecksum : uint8_t { kXxh3 = 0, kWords = 1 };

inline constexpr size_t kDeltaHeaderBytes = 32;

struct DeltaHeader {
  DeltaEncoding encoding = DeltaEncoding::kNone;
  uint32_t element_size = 0;
  DeltaValues values = DeltaValues::kRaw;
  uint64_t elements = 0;
  uint64_t changed = 0;
  DeltaChecksum checksum_kind = DeltaChecksum::kXxh3;
  uint64_t checksum = 0;  // of the tensor's bytes after applying
};

// Buffers an encoder reuses from one tensor to the next: fresh ones for every large tensor cost
// page faults and copies as they grow.
struct DeltaScratch {
  std::vector<uint64_t> index, before, after;  // the changed elements, their old and new bits
};

// Runs body(0) ... body(n - 1), on several threads if it has them, returning once all are done and
// rethrowing the exception of the lowest k that threw (HostCopyPool::for_each).
using DeltaForEach = std::function<void(size_t n, const std::function<void(size_t)>& body)>;
// The runner of `pool`'s threads, or none where it has none (alone, parts cost without gain).
DeltaForEach parts_on(HostCopyPool& pool);

struct DeltaResult {
  bool encoded = false;
  uint64_t checksum = 0;  // of `now`, when encoded
};

// Compares `now` with `base` (same size, a multiple of element_size, which is 1, 2, 4 or 8),
// hashes `now` in the same pass and makes `base` equal to `now`. When the record is smaller than
// `now` itself, writes it into `out` (replacing its contents) and returns {true, checksum};
// otherwise returns {false} and leaves `out` as it was (the caller sends the tensor whole).
// `scratch`, if given, holds the buffers of the scan (kept for the next call).
DeltaResult encode_delta(std::span<std::byte> base, std::span<const std::byte> now, size_t element_size,
                         std::vector<uint8_t>& out, DeltaScratch* scratch = nullptr);

// A large host tensor compared in parts on several threads: scan_delta_part on each part (`base`
// and `now` its bytes; parts start at multiples of 8 bytes, which element sizes divide), in any
// order, then join_delta_parts with all of them in order. The record is encode_delta's but for its
// checksum, the word hash (kWords), a sum over the parts that a destination computes in parts too.
struct DeltaPart {
  uint64_t first_byte = 0;        // of the part, in the tensor
  uint64_t bytes = 0;             // of the part
  DeltaScratch* found = nullptr;  // its changes, indexed within the part
  uint64_t hash_terms = 0;        // its words' terms of the word hash
  bool fits = false;              // its changes make a record smaller than it (the scan ran to its end)
};
void scan_delta_part(std::span<std::byte> base, std::span<const std::byte> now, size_t element_size, DeltaPart& part);
// `joined` holds the changes of all parts while the record is written. As encode_delta, makes
// `base` equal to `now` whether a record is written or the tensor goes whole.
DeltaResult join_delta_parts(std::span<std::byte> base, std::span<const std::byte> now, size_t element_size,
                             std::span<const DeltaPart> parts, std::vector<uint8_t>& out, DeltaScratch& joined);

// The same record made from changes found elsewhere (a GPU kernel's compaction): `index` (the
// changed elements, increasing), `before` and `after` (their bits as little-endian integers),
// `checksum` of the tensor after the change, of kind `kind`. `encoded` false, `out` left as it
// was: the record would not be smaller than the tensor.
struct ChangesToEncode {
  uint64_t elements = 0;
  size_t element_size = 0;
  std::span<const uint64_t> index, before, after;
  DeltaChecksum kind = DeltaChecksum::kWords;
  uint64_t checksum = 0;
  std::vector<uint8_t>* out = nullptr;
  bool encoded = false;
};
// Many tensors' records at once: with `for_each` their changes are cut into parts that all run
// together (a batch's few large tensors keep every thread busy); the records are the same.
void encode_delta_changes(std::span<ChangesToEncode> tensors, const DeltaForEach& for_each = {});
// One tensor's; returns `encoded`.
bool encode_delta_changes(uint64_t elements, size_t element_size, std::span<const uint64_t> index,
                          std::span<const uint64_t> before, std::span<const uint64_t> after, DeltaChecksum kind,
                          uint64_t checksum, std::vector<uint8_t>& out, const DeltaForEach& for_each = {});

// What a record of `changes` changes of `elements` elements is made of: its positions as gaps
// (`gap_bytes` of varints) or as a bitmap, its values as steps (`step_bytes`) or raw, each
// whichever is smaller. One rule for every writer (the host's, the GPU kernels').
struct DeltaRecordShape {
  DeltaEncoding encoding = DeltaEncoding::kNone;
  bool steps = false;
  uint64_t position_bytes = 0;
  uint64_t value_bytes = 0;
  uint64_t bytes() const { return kDeltaHeaderBytes + position_bytes + value_bytes; }
};
DeltaRecordShape delta_record_shape(uint64_t elements, size_t element_size, uint64_t changes, uint64_t gap_bytes,
                                    uint64_t step_bytes);

// Writes the kDeltaHeaderBytes of a record's header at `out`.
void write_delta_header(uint8_t* out, const DeltaRecordShape& shape, uint64_t elements, size_t element_size,
                        uint64_t changes, DeltaChecksum kind, uint64_t checksum);

// Reads and checks a record's header; `what` names the record in errors.
DeltaHeader read_delta_header(std::span<const uint8_t> record, const std::string& what);

// A record's changes, decoded and checked: the elements (increasing, in range) and for each its
// new bits (DeltaValues::kRaw) or its zigzagged step from the old bits (kSteps, within the
// element's range; delta_steps::unzigzag makes the new bits).
struct DeltaChanges {
  DeltaHeader header;
  std::vector<uint64_t> index;
  std::vector<uint64_t> values;
};

// Records are written, decoded and applied in a part per this many of their changes (about a
// quarter of a millisecond's work each), at most 64 a record when decoded: small enough that the
// parts of a batch's few large tensors keep every thread busy.
inline constexpr uint64_t kDeltaChangesPerPart = uint64_t{1} << 15;

// Decodes the record for a tensor of `target_bytes` bytes of `element_size`-byte elements,
// checking that it fits: the element size and count must match, positions must be in range and
// increasing, and the record must end where its values end. Error(kProtocol) naming `what`.
// A record of many changes is decoded in parts (its varints cut where one ends, found by counting
// their last bytes; its bitmap by bytes), run by `for_each` when given: the embedding's or the LM
// head's changes need not be one thread's work.
void decode_delta(std::span<const uint8_t> record, size_t element_size, uint64_t target_bytes, DeltaChanges& out,
                  const std::string& what, const DeltaForEach& for_each = {});

// A record to decode into memory the caller gives (page-locked memory a GPU copies from): `index`
// and `values` hold exactly the header's `changed` elements each (read_delta_header, which bounds
// it by the record's size). `header` is set to the record's.
struct RecordToDecode {
  std::span<const uint8_t> record;
  size_t element_size = 0;
  uint64_t target_bytes = 0;
  std::span<uint64_t> index, values;
  std::string what;
  DeltaHeader header;
};
// decode_delta of many records at once: with `for_each`, the parts of all of them run together
// (a batch's few large records and its many small ones keep every thread busy).
void decode_delta_into(std::span<RecordToDecode> records, const DeltaForEach& for_each = {});

// Applies each record to its `target` (the old version, in host memory, in place) once every
// record decoded (nothing is written if one is malformed), in parts by `for_each` as they decode.
// Sets each `header`. Does not check the checksum (the caller hashes what it holds afterwards).
struct RecordToApply {
  std::span<std::byte> target;
  size_t element_size = 0;
  std::span<const uint8_t> record;
  std::string what;
  DeltaHeader header;
};
void apply_delta(std::span<RecordToApply> records, const DeltaForEach& for_each = {});
// One record's; returns its header.
DeltaHeader apply_delta(std::span<std::byte> target, size_t element_size, std::span<const uint8_t> record,
                        const std::string& what, const DeltaForEach& for_each = {});

// The checksum of the bytes (host memory) of the given kind.
uint64_t delta_checksum(std::span<const std::byte> bytes, DeltaChecksum kind = DeltaChecksum::kXxh3);
// The word hash in parts (it is a sum): the terms of `bytes`, whose first word is word
// `first_word` of the tensor (only the tensor's last part may end inside a word). The checksum is
// word_hash::finish(the sum over all parts, the tensor's bytes).
uint64_t word_hash_terms(std::span<const std::byte> bytes, uint64_t first_word);

}  // namespace refit
