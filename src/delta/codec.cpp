#include "delta/codec.h"

#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cstring>

#include "core/fail.h"
#include "core/wire.h"
#include "delta/bits.h"

namespace refit {
namespace {

constexpr std::string_view kMagic = "RFD1";

// Bytes of the LEB128 varint of v.
size_t varint_size(uint64_t v) { return (std::bit_width(v | 1) + 6) / 7; }

uint8_t* put_varint(uint8_t* p, uint64_t v) {
  while (v >= 0x80) {
    *p++ = static_cast<uint8_t>(v | 0x80);
    v >>= 7;
  }
  *p++ = static_cast<uint8_t>(v);
  return p;
}

template <typename T>
uint8_t* put_le(uint8_t* p, T v) {
  auto bytes = wire::encode(v);
  std::memcpy(p, bytes.data(), bytes.size());
  return p + bytes.size();
}

uint64_t load_word(const std::byte* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  return w;
}

// An element's bytes as the little-endian integer they spell, whatever the host: both ends then
// take the same differences.
template <size_t Size>
uint64_t element_bits(const std::byte* p) {
  using U = typename wire::UnsignedOfSize<Size>::type;
  U v;
  std::memcpy(&v, p, Size);
  if constexpr (std::endian::native == std::endian::big) v = wire::byteswap(v);
  return v;
}

uint64_t element_bits(const std::byte* p, size_t size) {
  uint64_t v = 0;
  for (size_t k = 0; k < size; ++k) v |= static_cast<uint64_t>(p[k]) << (8 * k);
  return v;
}

// Writes `v` as the element's little-endian bytes, whatever the host.
template <size_t Size>
void store_element(std::byte* p, uint64_t v) {
  using U = typename wire::UnsignedOfSize<Size>::type;
  auto bits = static_cast<U>(v);
  if constexpr (std::endian::native == std::endian::big) bits = wire::byteswap(bits);
  std::memcpy(p, &bits, Size);
}

// What a scan found, in index order: the changed elements and their bits before and after, as a
// GPU kernel's compaction finds them too; one writer (write_record) makes the record of either.
struct Scan {
  explicit Scan(DeltaScratch& buffers) : index(buffers.index), before(buffers.before), after(buffers.after) {
    index.clear();
    before.clear();
    after.clear();
  }
  std::vector<uint64_t>& index;
  std::vector<uint64_t>& before;
  std::vector<uint64_t>& after;

  void add(uint64_t i, uint64_t old_bits, uint64_t new_bits) {
    index.push_back(i);
    before.push_back(old_bits);
    after.push_back(new_bits);
  }
};

// The smallest a record of `changes` changes of `elements` elements can be (at least one byte per
// position unless the bitmap is smaller, at least one byte per value): a scan stops once this
// reaches its budget.
uint64_t record_bytes_at_least(uint64_t changes, uint64_t elements) {
  return kDeltaHeaderBytes + std::min(changes, (elements + 7) / 8) + changes;
}

// How a scan hashes the new bytes: xxh3 of the whole tensor (one thread), or the word hash's terms
// of a part of it (its first word at `first_word` of the tensor; parts hash on several threads).
struct Xxh3Hash {
  XXH3_state_t* state;
  void add(const std::byte* data, size_t from, size_t bytes) { XXH3_64bits_update(state, data + from, bytes); }
};
struct WordTerms {
  uint64_t first_word = 0;
  uint64_t sum = 0;
  void add(const std::byte* data, size_t from, size_t bytes) {
    sum += word_hash_terms({data + from, bytes}, first_word + from / 8);
  }
};

// Finds the elements that differ, collects them (index, old and new bits), copies the new bytes
// into `base`, and hashes `now` on the way: one pass over the tensor's memory. Stops, returning
// false, once a record of the changes found would cost `budget` bytes or more (`base` is then
// partly updated). One instance per element size.
template <size_t Size, typename Hash>
bool scan(std::span<std::byte> base, std::span<const std::byte> now, uint64_t budget, Scan& s, Hash& hash) {
  const uint64_t elements = now.size() / Size;
  std::byte* a = base.data();
  const std::byte* b = now.data();
  // Eight bytes at a time (element sizes divide 8): a word that differs names its elements by
  // which lanes of the XOR are non-zero; 64 bytes that all match cost one test.
  constexpr size_t kLanes = 8 / Size;
  const size_t words = now.size() / 8;
  // Bit 8 * Size - 1 of every lane: the SWAR test below sets it where the lane is non-zero.
  constexpr uint64_t kHigh = [] {
    uint64_t h = 0;
    for (size_t lane = 0; lane < kLanes; ++lane) h |= uint64_t{1} << (8 * Size * lane + 8 * Size - 1);
    return h;
  }();
  // A lane's low bits carry into its top bit when any is set: the lanes that differ, without a
  // branch per lane (changes fall at random); then one turn per change. Lane j holds bytes
  // [j * Size, +Size) in memory order.
  auto word_changes = [&](size_t w) {
    const uint64_t x = load_word(a + w * 8) ^ load_word(b + w * 8);
    uint64_t differ = (((x & ~kHigh) + ~kHigh) | x) & kHigh;
    if (differ == 0) return;
    for (; differ != 0; differ &= differ - 1) {
      const size_t bit_lane = std::countr_zero(differ) / (8 * Size);
      const size_t lane = std::endian::native == std::endian::little ? bit_lane : kLanes - 1 - bit_lane;
      s.add(w * kLanes + lane, element_bits<Size>(a + w * 8 + lane * Size),
            element_bits<Size>(b + w * 8 + lane * Size));
    }
    std::memcpy(a + w * 8, b + w * 8, 8);
  };
  // Hashed in blocks that stay in cache between the hash and the compare.
  constexpr size_t kBlockWords = 4096;
  size_t w = 0;
  while (w + 8 <= words) {
    const size_t end = std::min(words - words % 8, w + kBlockWords);
    hash.add(b, w * 8, (end - w) * 8);
    for (; w < end; w += 8) {
      uint64_t any = 0;
      for (size_t k = 0; k < 8; ++k) any |= load_word(a + (w + k) * 8) ^ load_word(b + (w + k) * 8);
      if (any == 0) continue;
      for (size_t k = 0; k < 8; ++k) word_changes(w + k);
    }
    if (record_bytes_at_least(s.index.size(), elements) >= budget) return false;
  }
  hash.add(b, w * 8, now.size() - w * 8);
  for (; w < words; ++w) word_changes(w);
  // The tail shorter than a word.
  for (uint64_t i = w * kLanes; i < elements; ++i)
    if (std::memcmp(a + i * Size, b + i * Size, Size) != 0) {
      s.add(i, element_bits<Size>(a + i * Size), element_bits<Size>(b + i * Size));
      std::memcpy(a + i * Size, b + i * Size, Size);
    }
  return record_bytes_at_least(s.index.size(), elements) < budget;
}

template <template <size_t> typename F, typename... Args>
auto by_element_size(size_t size, Args&&... args) {
  switch (size) {
    case 1:
      return F<1>::run(std::forward<Args>(args)...);
    case 2:
      return F<2>::run(std::forward<Args>(args)...);
    case 4:
      return F<4>::run(std::forward<Args>(args)...);
    default:
      return F<8>::run(std::forward<Args>(args)...);
  }
}
template <size_t Size>
struct ScanOf {
  template <typename Hash>
  static bool run(std::span<std::byte> base, std::span<const std::byte> now, uint64_t budget, Scan& s, Hash& hash) {
    return scan<Size>(base, now, budget, s, hash);
  }
};

// Writes decoded changes into `target` (one instance per element size: no loop over bytes per change).
template <size_t Size>
struct PatchOf {
  static void run(std::span<std::byte> target, const DeltaChanges& changes) {
    const bool steps = changes.header.values == DeltaValues::kSteps;
    for (size_t k = 0; k < changes.index.size(); ++k) {
      std::byte* element = target.data() + changes.index[k] * Size;
      const uint64_t v = changes.values[k];
      store_element<Size>(element, steps ? delta_steps::unzigzag(element_bits<Size>(element), v, Size) : v);
    }
  }
};

// Writes the record of the changes (`index` increasing, `before`/`after` their bits) into `out`,
// unless the record would not be smaller than the tensor (`elements * element_size` bytes): then
// returns false and leaves `out` as it was.
bool write_record(uint64_t elements, size_t element_size, std::span<const uint64_t> index,
                  std::span<const uint64_t> before, std::span<const uint64_t> after, DeltaChecksum kind,
                  uint64_t checksum, std::vector<uint8_t>& out) {
  uint64_t gap_bytes = 0, step_bytes = 0, next_gap_from = 0;
  for (size_t k = 0; k < index.size(); ++k) {
    gap_bytes += varint_size(index[k] - next_gap_from);
    next_gap_from = index[k] + 1;
    step_bytes += varint_size(delta_steps::zigzag(before[k], after[k], element_size));
  }
  const DeltaRecordShape shape = delta_record_shape(elements, element_size, index.size(), gap_bytes, step_bytes);
  if (shape.bytes() >= elements * element_size) return false;
  out.assign(shape.bytes(), 0);
  write_delta_header(out.data(), shape, elements, element_size, index.size(), kind, checksum);
  uint8_t* p = out.data() + kDeltaHeaderBytes;
  if (shape.encoding == DeltaEncoding::kGaps) {
    next_gap_from = 0;
    for (uint64_t i : index) {
      p = put_varint(p, i - next_gap_from);
      next_gap_from = i + 1;
    }
  } else if (shape.encoding == DeltaEncoding::kBitmap) {
    for (uint64_t i : index) p[i / 8] |= static_cast<uint8_t>(1u << (i % 8));
    p += shape.position_bytes;
  }
  if (shape.steps) {
    for (size_t k = 0; k < index.size(); ++k) p = put_varint(p, delta_steps::zigzag(before[k], after[k], element_size));
  } else {
    for (uint64_t v : after) {
      for (size_t byte = 0; byte < element_size; ++byte) *p++ = static_cast<uint8_t>(v >> (8 * byte));
    }
  }
  return true;
}

void check_element_size(size_t element_size, const char* where) {
  if (element_size == 0 || element_size > 8 || 8 % element_size != 0)
    fail(ErrorKind::kInternal, "{}: {}-byte elements", where, element_size);
}

}  // namespace

DeltaRecordShape delta_record_shape(uint64_t elements, size_t element_size, uint64_t changes, uint64_t gap_bytes,
                                    uint64_t step_bytes) {
  DeltaRecordShape shape;
  const uint64_t bitmap_bytes = (elements + 7) / 8;
  const uint64_t raw_bytes = changes * element_size;
  shape.encoding = changes == 0                ? DeltaEncoding::kNone
                   : gap_bytes <= bitmap_bytes ? DeltaEncoding::kGaps
                                               : DeltaEncoding::kBitmap;
  shape.position_bytes =
      shape.encoding == DeltaEncoding::kNone ? 0 : (shape.encoding == DeltaEncoding::kGaps ? gap_bytes : bitmap_bytes);
  shape.steps = step_bytes < raw_bytes;
  shape.value_bytes = shape.steps ? step_bytes : raw_bytes;
  return shape;
}

void write_delta_header(uint8_t* out, const DeltaRecordShape& shape, uint64_t elements, size_t element_size,
                        uint64_t changes, DeltaChecksum kind, uint64_t checksum) {
  uint8_t* p = out;
  std::memcpy(p, kMagic.data(), kMagic.size());
  p += kMagic.size();
  p = put_le<uint8_t>(p, static_cast<uint8_t>(shape.encoding));
  p = put_le<uint8_t>(p, static_cast<uint8_t>(element_size));
  p = put_le<uint8_t>(p, static_cast<uint8_t>(shape.steps ? DeltaValues::kSteps : DeltaValues::kRaw));
  p = put_le<uint8_t>(p, static_cast<uint8_t>(kind));
  p = put_le<uint64_t>(p, elements);
  p = put_le<uint64_t>(p, changes);
  put_le<uint64_t>(p, checksum);
}

uint64_t word_hash_terms(std::span<const std::byte> bytes, uint64_t first_word) {
  uint64_t sum = 0;
  const size_t words = bytes.size() / 8;
  for (size_t w = 0; w < words; ++w) sum += word_hash::term(element_bits<8>(bytes.data() + w * 8), first_word + w);
  if (bytes.size() % 8 != 0)
    sum += word_hash::term(element_bits(bytes.data() + words * 8, bytes.size() % 8), first_word + words);
  return sum;
}

uint64_t delta_checksum(std::span<const std::byte> bytes, DeltaChecksum kind) {
  if (kind == DeltaChecksum::kXxh3) return XXH3_64bits(bytes.data(), bytes.size());
  return word_hash::finish(word_hash_terms(bytes, 0), bytes.size());
}

bool encode_delta_changes(uint64_t elements, size_t element_size, std::span<const uint64_t> index,
                          std::span<const uint64_t> before, std::span<const uint64_t> after, DeltaChecksum kind,
                          uint64_t checksum, std::vector<uint8_t>& out) {
  check_element_size(element_size, "encode_delta_changes");
  if (before.size() != index.size() || after.size() != index.size())
    fail(ErrorKind::kInternal, "encode_delta_changes: {} positions, {} and {} values", index.size(), before.size(),
         after.size());
  return write_record(elements, element_size, index, before, after, kind, checksum, out);
}

DeltaResult encode_delta(std::span<std::byte> base, std::span<const std::byte> now, size_t element_size,
                         std::vector<uint8_t>& out, DeltaScratch* scratch) {
  check_element_size(element_size, "encode_delta");
  if (base.size() != now.size() || now.size() % element_size != 0)
    fail(ErrorKind::kInternal, "encode_delta: {} and {} bytes of {}-byte elements", base.size(), now.size(),
         element_size);
  const uint64_t elements = now.size() / element_size;
  DeltaScratch local;
  Scan s(scratch != nullptr ? *scratch : local);
  XXH3_state_t* hash = XXH3_createState();
  if (hash == nullptr) throw std::bad_alloc();
  XXH3_64bits_reset(hash);
  Xxh3Hash xxh3{hash};
  const bool fits = by_element_size<ScanOf>(element_size, base, now, uint64_t{now.size()}, s, xxh3);
  const uint64_t checksum = fits ? XXH3_64bits_digest(hash) : 0;
  XXH3_freeState(hash);
  if (!fits || !write_record(elements, element_size, s.index, s.before, s.after, DeltaChecksum::kXxh3, checksum, out)) {
    if (!now.empty()) std::memcpy(base.data(), now.data(), now.size());  // the scan may have stopped part way
    return {};
  }
  return {true, checksum};
}

void scan_delta_part(std::span<std::byte> base, std::span<const std::byte> now, size_t element_size, DeltaPart& part) {
  check_element_size(element_size, "scan_delta_part");
  if (base.size() != now.size() || part.first_byte % 8 != 0 || part.found == nullptr)
    fail(ErrorKind::kInternal, "scan_delta_part: {} and {} bytes at byte {}", base.size(), now.size(), part.first_byte);
  Scan s(*part.found);
  WordTerms terms{part.first_byte / 8, 0};
  // A part's own size bounds its share of the record (the header is the tensor's, once) as the
  // tensor's size bounds a whole scan.
  part.fits = by_element_size<ScanOf>(element_size, base, now, now.size() + kDeltaHeaderBytes, s, terms);
  part.hash_terms = terms.sum;
}

DeltaResult join_delta_parts(std::span<std::byte> base, std::span<const std::byte> now, size_t element_size,
                             std::span<const DeltaPart> parts, std::vector<uint8_t>& out, DeltaScratch& joined) {
  check_element_size(element_size, "join_delta_parts");
  const uint64_t elements = now.size() / element_size;
  bool fits = true;
  uint64_t sum = 0, next_byte = 0;
  for (const DeltaPart& part : parts) {
    if (part.first_byte != next_byte || part.found == nullptr)
      fail(ErrorKind::kInternal, "join_delta_parts: a part at byte {} where {} was due", part.first_byte, next_byte);
    if (part.bytes % 8 != 0 && &part != &parts.back())
      fail(ErrorKind::kInternal, "join_delta_parts: a {}-byte part before the last", part.bytes);
    fits = fits && part.fits;
    sum += part.hash_terms;
    next_byte = part.first_byte + part.bytes;
  }
  if (next_byte != now.size() || base.size() != now.size())
    fail(ErrorKind::kInternal, "join_delta_parts: parts of {} bytes for a {}-byte tensor", next_byte, now.size());
  Scan s(joined);
  if (fits)
    for (const DeltaPart& part : parts) {
      const uint64_t first = part.first_byte / element_size;
      for (size_t k = 0; k < part.found->index.size(); ++k)
        s.add(first + part.found->index[k], part.found->before[k], part.found->after[k]);
    }
  const uint64_t checksum = word_hash::finish(sum, now.size());
  if (!fits ||
      !write_record(elements, element_size, s.index, s.before, s.after, DeltaChecksum::kWords, checksum, out)) {
    if (!now.empty()) std::memcpy(base.data(), now.data(), now.size());  // a part may have stopped part way
    return {};
  }
  return {true, checksum};
}

DeltaHeader read_delta_header(std::span<const uint8_t> record, const std::string& what) {
  ByteReader in(record, what);
  in.expect_magic(kMagic);
  DeltaHeader h;
  const uint8_t encoding = in.get<uint8_t>("encoding");
  if (encoding > static_cast<uint8_t>(DeltaEncoding::kBitmap))
    fail(ErrorKind::kProtocol, "malformed {}: unknown encoding {}", what, encoding);
  h.encoding = static_cast<DeltaEncoding>(encoding);
  h.element_size = in.get<uint8_t>("element size");
  const uint8_t values = in.get<uint8_t>("values");
  if (values > static_cast<uint8_t>(DeltaValues::kSteps))
    fail(ErrorKind::kProtocol, "malformed {}: unknown value coding {}", what, values);
  h.values = static_cast<DeltaValues>(values);
  const uint8_t kind = in.get<uint8_t>("checksum kind");
  if (kind > static_cast<uint8_t>(DeltaChecksum::kWords))
    fail(ErrorKind::kProtocol, "malformed {}: unknown checksum kind {}", what, kind);
  h.checksum_kind = static_cast<DeltaChecksum>(kind);
  h.elements = in.get<uint64_t>("elements");
  h.changed = in.get<uint64_t>("changed");
  h.checksum = in.get<uint64_t>("checksum");
  if (h.changed > h.elements)
    fail(ErrorKind::kProtocol, "malformed {}: {} changed of {} elements", what, h.changed, h.elements);
  if ((h.encoding == DeltaEncoding::kNone) != (h.changed == 0))
    fail(ErrorKind::kProtocol, "malformed {}: encoding {} with {} changed elements", what, encoding, h.changed);
  return h;
}

void decode_delta(std::span<const uint8_t> record, size_t element_size, uint64_t target_bytes, DeltaChanges& out,
                  const std::string& what) {
  const DeltaHeader h = read_delta_header(record, what);
  out.header = h;
  if (h.element_size != element_size || element_size == 0 || element_size > 8 ||
      h.elements * element_size != target_bytes || h.elements > target_bytes)
    fail(ErrorKind::kProtocol, "{} is for {} elements of {} bytes, but the tensor has {} bytes of {}-byte elements",
         what, h.elements, h.element_size, target_bytes, element_size);
  const uint8_t* p = record.data() + kDeltaHeaderBytes;
  const uint8_t* const end = record.data() + record.size();
  auto varint = [&](const char* field, uint64_t k) {
    uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      if (p >= end || shift > 63) fail(ErrorKind::kProtocol, "malformed {}: {} {} is cut off", what, field, k);
      const uint8_t byte = *p++;
      v |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if (!(byte & 0x80)) return v;
    }
  };
  // Positions first (checked whole before anything is written), then the values.
  if (h.changed > static_cast<uint64_t>(end - p))
    fail(ErrorKind::kProtocol, "malformed {}: {} bytes cannot hold {} changes", what, end - p, h.changed);
  std::vector<uint64_t>& index = out.index;
  index.clear();
  index.reserve(h.changed);
  if (h.encoding == DeltaEncoding::kGaps) {
    uint64_t previous = 0;
    for (uint64_t k = 0; k < h.changed; ++k) {
      const uint64_t gap = varint("position", k);
      const uint64_t i = k == 0 ? gap : previous + 1 + gap;
      if (gap >= h.elements || i >= h.elements || (k > 0 && i <= previous))
        fail(ErrorKind::kProtocol, "malformed {}: position {} is past element {}", what, k, h.elements);
      index.push_back(i);
      previous = i;
    }
  } else if (h.encoding == DeltaEncoding::kBitmap) {
    const uint64_t bitmap_bytes = (h.elements + 7) / 8;
    if (static_cast<uint64_t>(end - p) < bitmap_bytes)
      fail(ErrorKind::kProtocol, "malformed {}: the bitmap of {} elements is cut off", what, h.elements);
    for (uint64_t i = 0; i < h.elements; ++i)
      if (p[i / 8] & (1u << (i % 8))) index.push_back(i);
    // Bits past the last element must be clear, or two records could mean one change.
    if (h.elements % 8 != 0 && (p[bitmap_bytes - 1] >> (h.elements % 8)) != 0)
      fail(ErrorKind::kProtocol, "malformed {}: bitmap bits set past element {}", what, h.elements);
    if (index.size() != h.changed)
      fail(ErrorKind::kProtocol, "malformed {}: the bitmap marks {} elements, the header says {}", what, index.size(),
           h.changed);
    p += bitmap_bytes;
  }
  std::vector<uint64_t>& fresh = out.values;
  fresh.resize(index.size());
  if (h.values == DeltaValues::kRaw) {
    if (static_cast<uint64_t>(end - p) != index.size() * element_size)
      fail(ErrorKind::kProtocol, "malformed {}: {} bytes of values for {} changes of {} bytes", what, end - p,
           index.size(), element_size);
    for (size_t k = 0; k < index.size(); ++k)
      fresh[k] = element_bits(reinterpret_cast<const std::byte*>(p) + k * element_size, element_size);
    p = end;
  } else {
    for (size_t k = 0; k < index.size(); ++k) {
      const uint64_t z = varint("value", k);
      // A step larger than the element's range would be a second spelling of another step.
      if (element_size < 8 && (z >> (8 * element_size)) != 0)
        fail(ErrorKind::kProtocol, "malformed {}: value {} steps by {} in {}-byte elements", what, k, z, element_size);
      fresh[k] = z;
    }
  }
  if (p != end) fail(ErrorKind::kProtocol, "malformed {}: {} bytes after the values", what, end - p);
}

DeltaHeader apply_delta(std::span<std::byte> target, size_t element_size, std::span<const uint8_t> record,
                        const std::string& what) {
  DeltaChanges changes;
  decode_delta(record, element_size, target.size(), changes, what);
  by_element_size<PatchOf>(element_size, target, changes);
  return changes.header;
}

}  // namespace refit
