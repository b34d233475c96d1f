// The delta of one tensor between two versions: which elements changed and their new values,
// compared and written as bits (nothing is added or subtracted, so applying a delta to the old
// version gives the new one bit for bit; -0.0 vs 0.0 or two NaN payloads count as changes).
//
// A record is self-describing: a fixed header (magic "RFD1", position encoding, element size,
// value coding, element count, changed count, xxh3-64 of the whole tensor after the change), then
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
#include <span>
#include <string>
#include <vector>

namespace refit {

enum class DeltaEncoding : uint8_t { kNone = 0, kGaps = 1, kBitmap = 2 };
enum class DeltaValues : uint8_t { kRaw = 0, kSteps = 1 };

inline constexpr size_t kDeltaHeaderBytes = 32;

struct DeltaHeader {
  DeltaEncoding encoding = DeltaEncoding::kNone;
  uint32_t element_size = 0;
  DeltaValues values = DeltaValues::kRaw;
  uint64_t elements = 0;
  uint64_t changed = 0;
  uint64_t checksum = 0;  // xxh3-64 of the tensor's bytes after applying
};

// Buffers an encoder reuses from one tensor to the next: fresh ones for every large tensor cost
// page faults and copies as they grow.
struct DeltaScratch {
  std::vector<uint64_t> changed;
  std::vector<uint8_t> steps, raw;
};

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

// Reads and checks a record's header; `what` names the record in errors.
DeltaHeader read_delta_header(std::span<const uint8_t> record, const std::string& what);

// Applies the record to `target` (the old version, in place), after checking that it fits: the
// element size and count must match `target`, positions must be in range and increasing, and the
// record must end where its values end. Returns the header. Does not check the checksum (the
// caller hashes what it holds afterwards).
DeltaHeader apply_delta(std::span<std::byte> target, size_t element_size, std::span<const uint8_t> record,
                        const std::string& what);

// xxh3-64 of the bytes.
uint64_t delta_checksum(std::span<const std::byte> bytes);

}  // namespace refit
