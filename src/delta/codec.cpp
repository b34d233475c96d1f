#include "delta/codec.h"

#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <functional>
#include <memory>
#include <utility>

#include "core/fail.h"
#include "core/wire.h"
#include "delta/bits.h"
#include "memory/host_copy_pool.h"

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
// GPU kernel's compaction finds them too; one writer (write_records) makes the record of either.
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
  static void run(std::span<std::byte> target, const RecordToDecode& changes, uint64_t first, uint64_t last) {
    const bool steps = changes.header.values == DeltaValues::kSteps;
    for (uint64_t k = first; k < last; ++k) {
      std::byte* element = target.data() + changes.index[k] * Size;
      const uint64_t v = changes.values[k];
      store_element<Size>(element, steps ? delta_steps::unzigzag(element_bits<Size>(element), v, Size) : v);
    }
  }
};

constexpr size_t kMaxParts = 64;

// How many parts `units` of work (changes, or bitmap bits) go in: one per kDeltaChangesPerPart, at most
// kMaxParts, and one without a runner (alone, a part's cut and count cost without gain).
size_t parts_for(uint64_t units, const DeltaForEach& for_each) {
  return for_each ? static_cast<size_t>(std::clamp<uint64_t>(units / kDeltaChangesPerPart, 1, kMaxParts)) : 1;
}

// body(0) ... body(n - 1) by `for_each`, or one after the other without one.
void run_parts(const DeltaForEach& for_each, size_t n, const std::function<void(size_t)>& body) {
  if (for_each && n > 1) return for_each(n, body);
  for (size_t k = 0; k < n; ++k) body(k);
}

// Writes each tensor's record of its changes (`index` increasing, `before`/`after` their bits) into
// its `out`, unless the record would not be smaller than the tensor (`encoded` false, `out` left as
// it was). With a runner every tensor's changes are cut into parts, all of them run together: each
// part sizes its varints; then each tensor, its parts' sizes summed, takes its shape and header;
// then each part writes its varints where the parts before it end. The same bytes as one pass.
void write_records(std::span<ChangesToEncode> tensors, const DeltaForEach& for_each) {
  struct Part {
    size_t tensor = 0;
    uint64_t first = 0, last = 0;      // its changes
    uint64_t gap_at = 0, step_at = 0;  // its varints' bytes, then where they go
  };
  std::vector<Part> parts;
  std::vector<size_t> first_part;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const uint64_t n = tensors[t].index.size();
    const size_t count = parts_for(n, for_each);
    first_part.push_back(parts.size());
    for (uint64_t p = 0; p < count; ++p) parts.push_back({t, n * p / count, n * (p + 1) / count});
  }
  first_part.push_back(parts.size());
  // A gap counts from the element after the previous change: a part's first gap from its neighbour's last.
  auto gap_origin = [](const ChangesToEncode& c, uint64_t k) { return k == 0 ? uint64_t{0} : c.index[k - 1] + 1; };
  run_parts(for_each, parts.size(), [&](size_t i) {
    Part& part = parts[i];
    const ChangesToEncode& c = tensors[part.tensor];
    uint64_t from = gap_origin(c, part.first), gaps = 0, steps = 0;  // summed here: neighbours share a line
    for (uint64_t k = part.first; k < part.last; ++k) {
      gaps += varint_size(c.index[k] - from);
      from = c.index[k] + 1;
      steps += varint_size(delta_steps::zigzag(c.before[k], c.after[k], c.element_size));
    }
    part.gap_at = gaps;
    part.step_at = steps;
  });
  std::vector<DeltaRecordShape> shapes(tensors.size());
  run_parts(for_each, tensors.size(), [&](size_t t) {
    ChangesToEncode& c = tensors[t];
    uint64_t gaps = 0, steps = 0;
    for (size_t i = first_part[t]; i < first_part[t + 1]; ++i) {
      gaps += std::exchange(parts[i].gap_at, gaps);
      steps += std::exchange(parts[i].step_at, steps);
    }
    const DeltaRecordShape shape = delta_record_shape(c.elements, c.element_size, c.index.size(), gaps, steps);
    c.encoded = shape.bytes() < c.elements * c.element_size;
    if (!c.encoded) return;
    shapes[t] = shape;
    c.out->assign(shape.bytes(), 0);
    write_delta_header(c.out->data(), shape, c.elements, c.element_size, c.index.size(), c.kind, c.checksum);
    if (shape.encoding == DeltaEncoding::kBitmap) {  // parts could share a byte: one pass, a bit each
      uint8_t* const positions = c.out->data() + kDeltaHeaderBytes;
      for (uint64_t i : c.index) positions[i / 8] |= static_cast<uint8_t>(1u << (i % 8));
    }
  });
  run_parts(for_each, parts.size(), [&](size_t i) {
    const Part& part = parts[i];
    const ChangesToEncode& c = tensors[part.tensor];
    if (!c.encoded) return;
    const DeltaRecordShape& shape = shapes[part.tensor];
    uint8_t* const positions = c.out->data() + kDeltaHeaderBytes;
    uint8_t* const values = positions + shape.position_bytes;
    if (shape.encoding == DeltaEncoding::kGaps) {
      uint8_t* p = positions + part.gap_at;
      uint64_t from = gap_origin(c, part.first);
      for (uint64_t k = part.first; k < part.last; ++k) {
        p = put_varint(p, c.index[k] - from);
        from = c.index[k] + 1;
      }
    }
    if (shape.steps) {
      uint8_t* p = values + part.step_at;
      for (uint64_t k = part.first; k < part.last; ++k)
        p = put_varint(p, delta_steps::zigzag(c.before[k], c.after[k], c.element_size));
    } else {
      uint8_t* p = values + part.first * c.element_size;
      for (uint64_t k = part.first; k < part.last; ++k)
        for (size_t byte = 0; byte < c.element_size; ++byte) *p++ = static_cast<uint8_t>(c.after[k] >> (8 * byte));
    }
  });
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

DeltaForEach parts_on(HostCopyPool& pool) {
  if (pool.threads() == 0) return {};
  return [&pool](size_t n, const std::function<void(size_t)>& body) { pool.for_each(n, body); };
}

void encode_delta_changes(std::span<ChangesToEncode> tensors, const DeltaForEach& for_each) {
  for (const ChangesToEncode& c : tensors) {
    check_element_size(c.element_size, "encode_delta_changes");
    if (c.before.size() != c.index.size() || c.after.size() != c.index.size() || c.out == nullptr)
      fail(ErrorKind::kInternal, "encode_delta_changes: {} positions, {} and {} values", c.index.size(),
           c.before.size(), c.after.size());
  }
  write_records(tensors, for_each);
}

bool encode_delta_changes(uint64_t elements, size_t element_size, std::span<const uint64_t> index,
                          std::span<const uint64_t> before, std::span<const uint64_t> after, DeltaChecksum kind,
                          uint64_t checksum, std::vector<uint8_t>& out, const DeltaForEach& for_each) {
  ChangesToEncode c{elements, element_size, index, before, after, kind, checksum, &out};
  encode_delta_changes({&c, 1}, for_each);
  return c.encoded;
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
  if (!fits ||
      !encode_delta_changes(elements, element_size, s.index, s.before, s.after, DeltaChecksum::kXxh3, checksum, out)) {
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
      !encode_delta_changes(elements, element_size, s.index, s.before, s.after, DeltaChecksum::kWords, checksum, out)) {
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
  // Every change takes at least a byte of values: what a reader allocates stays within the record's size.
  if (h.changed > record.size() - kDeltaHeaderBytes)
    fail(ErrorKind::kProtocol, "malformed {}: {} bytes cannot hold {} changes", what, record.size() - kDeltaHeaderBytes,
         h.changed);
  return h;
}

namespace {

// [first, last) of `count`, cut into `parts` runs: run r is [cut(r), cut(r + 1)).
uint64_t cut_at(uint64_t count, size_t parts, size_t r) { return count * r / parts; }

// Where a record's varints go: varint k < `changed` is a position, as its gap from the one before
// plus one (the first's from -1), else the step of change k - changed.
struct VarintSink {
  std::string_view what;
  const char* holding;  // "the positions and values", "the values"
  uint64_t changed, elements;
  size_t element_size;
  uint64_t* index;
  uint64_t* steps;
};

// Decodes varints [k, last) from `q` on, the bytes ending at `end` at the latest. Positions are
// summed from `running` (-1 for the record's first), each one's sum stored: where the varints
// were cut into runs, a run's sums lack those of the runs before it. Returns the byte after the
// last varint and the sum.
std::pair<const uint8_t*, uint64_t> decode_run(const uint8_t* q, const uint8_t* end, uint64_t k, uint64_t last,
                                               uint64_t running, const VarintSink& to) {
  // The sink's fields in locals: its pointers could alias them, which would reload each per change.
  const uint64_t changed = to.changed, elements = to.elements;
  const size_t element_size = to.element_size;
  uint64_t* const index = to.index;
  uint64_t* const steps = to.steps;
  auto varint = [&](uint64_t n) {
    if (q < end && *q < 0x80) return uint64_t{*q++};  // most are one byte
    uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      if (q >= end) fail(ErrorKind::kProtocol, "malformed {}: varint {} of {} is cut off", to.what, n, to.holding);
      if (shift > 63)
        fail(ErrorKind::kProtocol, "malformed {}: varint {} of {} runs past 64 bits", to.what, n, to.holding);
      const uint8_t byte = *q++;
      v |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if (!(byte & 0x80)) return v;
    }
  };
  for (const uint64_t positions_end = std::min(last, changed); k < positions_end; ++k) {
    const uint64_t gap = varint(k);
    running += gap + 1;
    if (gap >= elements || running >= elements)
      fail(ErrorKind::kProtocol, "malformed {}: position {} is past element {}", to.what, k, elements);
    index[k] = running;
  }
  for (k = std::max(k, changed); k < last; ++k) {
    const uint64_t z = varint(k);
    // A step larger than the element's range would be a second spelling of another step.
    if (element_size < 8 && (z >> (8 * element_size)) != 0)
      fail(ErrorKind::kProtocol, "malformed {}: value {} steps by {} in {}-byte elements", to.what, k - changed, z,
           element_size);
    steps[k - changed] = z;
  }
  return {q, running};
}

// A record decodes as one or two chains (its positions', its values') of rounds: a round's parts
// are independent, and after(round) runs once they all ended. The chains of every record of a
// batch run their rounds together (run_chains), so a batch's few large records and its many small
// ones keep every thread busy. Every check is made before a target is written (the caller patches
// only once all decoded).
class DecodeChain {
 public:
  virtual ~DecodeChain() = default;
  virtual size_t rounds() const = 0;
  virtual size_t parts(size_t round) const = 0;
  virtual void run(size_t round, size_t part) = 0;
  virtual void after(size_t /*round*/) {}
};

void run_chains(std::span<const std::unique_ptr<DecodeChain>> chains, const DeltaForEach& for_each) {
  struct Work {
    DecodeChain* chain;
    size_t part;
  };
  std::vector<Work> work;
  for (size_t round = 0;; ++round) {
    work.clear();
    for (const auto& chain : chains)
      if (round < chain->rounds())
        for (size_t k = 0; k < chain->parts(round); ++k) work.push_back({chain.get(), k});
    if (work.empty()) return;
    run_parts(for_each, work.size(), [&](size_t i) { work[i].chain->run(round, work[i].part); });
    for (const auto& chain : chains)
      if (round < chain->rounds()) chain->after(round);
  }
}

// The `count` varints that [begin, end) holds, exactly, into `to`, in `parts` runs: each run
// starts after a varint's last byte (a byte below 0x80), its first varint's number found by
// counting those bytes before it (round 0); the runs decode (round 1); runs after the first then
// add the positions' sums of the runs before them (round 2). One run decodes in one round.
class VarintChain final : public DecodeChain {
 public:
  VarintChain(const uint8_t* begin, const uint8_t* end, uint64_t count, size_t parts, const VarintSink& to)
      : begin_(begin), end_(end), count_(count), to_(to) {
    const auto bytes = static_cast<uint64_t>(end - begin);
    runs_ = bytes < parts ? 1 : parts;
    if (runs_ <= 1) return;
    if (end[-1] & 0x80)
      fail(ErrorKind::kProtocol, "malformed {}: the {} bytes of {} end inside a varint", to.what, bytes, to.holding);
    cuts_.assign(runs_ + 1, end);
    cuts_[0] = begin;
    for (size_t r = 1; r < runs_; ++r) {
      const uint8_t* c = std::max(begin + cut_at(bytes, runs_, r), cuts_[r - 1]);
      while (c < end && (c[-1] & 0x80)) ++c;
      cuts_[r] = c;
    }
    first_.assign(runs_ + 1, 0);
    running_.assign(runs_, 0);
  }
  size_t rounds() const override { return runs_ <= 1 ? 1 : 3; }
  size_t parts(size_t round) const override { return round == 2 ? runs_ - 1 : runs_; }
  void run(size_t round, size_t r) override {
    if (runs_ <= 1) {
      const uint8_t* after = decode_run(begin_, end_, 0, count_, UINT64_MAX, to_).first;
      if (after != end_)
        fail(ErrorKind::kProtocol, "malformed {}: {} bytes after {}", to_.what, end_ - after, to_.holding);
    } else if (round == 0) {
      uint64_t n = 0;
      for (const uint8_t* q = cuts_[r]; q < cuts_[r + 1]; ++q) n += (*q & 0x80) == 0;
      first_[r + 1] = n;
    } else if (round == 1) {
      running_[r] = decode_run(cuts_[r], cuts_[r + 1], first_[r], first_[r + 1], UINT64_MAX, to_).second;
    } else {
      ++r;  // run r + 1: the first run's sums are whole
      for (uint64_t k = first_[r]; k < std::min(first_[r + 1], to_.changed); ++k) {
        to_.index[k] += base_[r];
        if (to_.index[k] >= to_.elements)
          fail(ErrorKind::kProtocol, "malformed {}: position {} is past element {}", to_.what, k, to_.elements);
      }
    }
  }
  void after(size_t round) override {
    if (runs_ <= 1) return;
    if (round == 0) {
      for (size_t r = 0; r < runs_; ++r) first_[r + 1] += first_[r];
      if (first_[runs_] != count_)
        fail(ErrorKind::kProtocol, "malformed {}: the {} bytes of {} hold {} varints where its changes need {}",
             to_.what, end_ - begin_, to_.holding, first_[runs_], count_);
    } else if (round == 1) {
      // Run r's positions lie past the last of the runs before it (a run without positions adds none).
      base_.assign(runs_, 0);
      for (size_t r = 1; r < runs_; ++r) {
        base_[r] = base_[r - 1] + (running_[r - 1] + 1);
        if (base_[r] > to_.elements)
          fail(ErrorKind::kProtocol, "malformed {}: position {} is past element {}", to_.what, first_[r], to_.elements);
      }
    }
  }

 private:
  const uint8_t *begin_, *end_;
  uint64_t count_;
  VarintSink to_;
  size_t runs_ = 1;
  std::vector<const uint8_t*> cuts_;
  std::vector<uint64_t> first_;           // the varints before each run
  std::vector<uint64_t> running_, base_;  // each run's last position's sum, and what it adds
};

// A bitmap's set bits, in `runs` runs of its bytes: each run counts its bits (round 0), then
// writes its positions after the runs before it (round 1).
class BitmapChain final : public DecodeChain {
 public:
  BitmapChain(const uint8_t* bitmap, uint64_t bytes, uint64_t changed, size_t runs, uint64_t* index,
              std::string_view what)
      : bitmap_(bitmap),
        bytes_(bytes),
        changed_(changed),
        runs_(runs),
        index_(index),
        what_(what),
        first_(runs + 1, 0) {}
  size_t rounds() const override { return 2; }
  size_t parts(size_t) const override { return runs_; }
  void run(size_t round, size_t r) override {
    const uint64_t from = cut_at(bytes_, runs_, r), to = cut_at(bytes_, runs_, r + 1);
    if (round == 0) {
      uint64_t n = 0;
      for (uint64_t b = from; b < to; ++b) n += static_cast<uint64_t>(std::popcount(bitmap_[b]));
      first_[r + 1] = n;
      return;
    }
    uint64_t k = first_[r];
    for (uint64_t b = from; b < to; ++b)
      for (unsigned bits = bitmap_[b]; bits != 0; bits &= bits - 1) index_[k++] = b * 8 + std::countr_zero(bits);
  }
  void after(size_t round) override {
    if (round != 0) return;
    for (size_t r = 0; r < runs_; ++r) first_[r + 1] += first_[r];
    if (first_[runs_] != changed_)
      fail(ErrorKind::kProtocol, "malformed {}: the bitmap marks {} elements, the header says {}", what_, first_[runs_],
           changed_);
  }

 private:
  const uint8_t* bitmap_;
  uint64_t bytes_, changed_;
  size_t runs_;
  uint64_t* index_;
  std::string_view what_;
  std::vector<uint64_t> first_;
};

// Values stored whole, little-endian, `changed` of `element_size` bytes: one round of parts.
class RawValuesChain final : public DecodeChain {
 public:
  RawValuesChain(const uint8_t* values, uint64_t changed, size_t element_size, size_t parts, uint64_t* out)
      : values_(values), changed_(changed), element_size_(element_size), parts_(parts), out_(out) {}
  size_t rounds() const override { return 1; }
  size_t parts(size_t) const override { return parts_; }
  void run(size_t, size_t r) override {
    for (uint64_t k = cut_at(changed_, parts_, r); k < cut_at(changed_, parts_, r + 1); ++k)
      out_[k] = element_bits(reinterpret_cast<const std::byte*>(values_) + k * element_size_, element_size_);
  }

 private:
  const uint8_t* values_;
  uint64_t changed_;
  size_t element_size_, parts_;
  uint64_t* out_;
};

// Checks `r`'s header against its tensor and the room it is given, sets r.header, and adds the
// chains that decode it.
void add_chains(RecordToDecode& r, const DeltaForEach& for_each, std::vector<std::unique_ptr<DecodeChain>>& chains) {
  const DeltaHeader h = r.header = read_delta_header(r.record, r.what);
  const size_t element_size = r.element_size;
  if (h.element_size != element_size || element_size == 0 || element_size > 8 ||
      h.elements * element_size != r.target_bytes || h.elements > r.target_bytes)
    fail(ErrorKind::kProtocol, "{} is for {} elements of {} bytes, but the tensor has {} bytes of {}-byte elements",
         r.what, h.elements, h.element_size, r.target_bytes, element_size);
  if (r.index.size() != h.changed || r.values.size() != h.changed)
    fail(ErrorKind::kInternal, "decode_delta_into: room for {} and {} of {} changes of {}", r.index.size(),
         r.values.size(), h.changed, r.what);
  const uint8_t* p = r.record.data() + kDeltaHeaderBytes;
  const uint8_t* const end = r.record.data() + r.record.size();
  const uint64_t changed = h.changed;
  const size_t parts = parts_for(changed, for_each);
  const bool steps = h.values == DeltaValues::kSteps;
  const uint64_t raw_bytes = steps ? 0 : changed * element_size;
  if (h.encoding == DeltaEncoding::kGaps) {
    if (raw_bytes > static_cast<uint64_t>(end - p))
      fail(ErrorKind::kProtocol, "malformed {}: {} bytes cannot hold {} changes of {} bytes", r.what, end - p, changed,
           element_size);
    // With steps, the gaps' varints and then the steps' fill the record: one run of varints.
    const uint8_t* const values = end - raw_bytes;
    chains.push_back(std::make_unique<VarintChain>(p, values, steps ? 2 * changed : changed, parts,
                                                   VarintSink{r.what, "the positions and values", changed, h.elements,
                                                              element_size, r.index.data(), r.values.data()}));
    if (steps) return;
    p = values;
  } else if (h.encoding == DeltaEncoding::kBitmap) {
    const uint64_t bitmap_bytes = (h.elements + 7) / 8;
    if (static_cast<uint64_t>(end - p) < bitmap_bytes)
      fail(ErrorKind::kProtocol, "malformed {}: the bitmap of {} elements is cut off", r.what, h.elements);
    // Bits past the last element must be clear, or two records could mean one change.
    if (h.elements % 8 != 0 && (p[bitmap_bytes - 1] >> (h.elements % 8)) != 0)
      fail(ErrorKind::kProtocol, "malformed {}: bitmap bits set past element {}", r.what, h.elements);
    chains.push_back(std::make_unique<BitmapChain>(p, bitmap_bytes, changed, parts_for(8 * bitmap_bytes, for_each),
                                                   r.index.data(), r.what));
    p += bitmap_bytes;
  }
  if (steps) {
    chains.push_back(std::make_unique<VarintChain>(
        p, end, changed, parts,
        VarintSink{r.what, "the values", 0, h.elements, element_size, r.index.data(), r.values.data()}));
    return;
  }
  if (static_cast<uint64_t>(end - p) != raw_bytes)
    fail(ErrorKind::kProtocol, "malformed {}: {} bytes of values for {} changes of {} bytes", r.what, end - p, changed,
         element_size);
  chains.push_back(std::make_unique<RawValuesChain>(p, changed, element_size, parts, r.values.data()));
}

}  // namespace

void decode_delta_into(std::span<RecordToDecode> records, const DeltaForEach& for_each) {
  std::vector<std::unique_ptr<DecodeChain>> chains;
  for (RecordToDecode& r : records) add_chains(r, for_each, chains);
  run_chains(chains, for_each);
}

void decode_delta(std::span<const uint8_t> record, size_t element_size, uint64_t target_bytes, DeltaChanges& out,
                  const std::string& what, const DeltaForEach& for_each) {
  out.header = read_delta_header(record, what);
  out.index.resize(out.header.changed);
  out.values.resize(out.header.changed);
  RecordToDecode r{record, element_size, target_bytes, out.index, out.values, what, {}};
  decode_delta_into({&r, 1}, for_each);
}

void apply_delta(std::span<RecordToApply> records, const DeltaForEach& for_each) {
  // The changes of all records in one array, left uninitialized: the decode's parts touch its pages
  // on their threads.
  std::vector<RecordToDecode> decoded;
  uint64_t total = 0;
  for (const RecordToApply& r : records) {
    decoded.push_back({r.record, r.element_size, r.target.size(), {}, {}, r.what, read_delta_header(r.record, r.what)});
    total += decoded.back().header.changed;
  }
  const std::unique_ptr<uint64_t[]> changes(new uint64_t[2 * total]);
  uint64_t at = 0;
  for (RecordToDecode& d : decoded) {
    const uint64_t changed = d.header.changed;
    d.index = {changes.get() + at, changed};
    d.values = {changes.get() + at + changed, changed};
    at += 2 * changed;
  }
  decode_delta_into(decoded, for_each);
  // Each change is another element's: the parts write apart.
  struct Part {
    size_t record;
    uint64_t first, last;
  };
  std::vector<Part> parts;
  for (size_t t = 0; t < records.size(); ++t) {
    records[t].header = decoded[t].header;
    const uint64_t changed = decoded[t].header.changed;
    const size_t n = parts_for(changed, for_each);
    for (size_t r = 0; r < n; ++r) parts.push_back({t, cut_at(changed, n, r), cut_at(changed, n, r + 1)});
  }
  run_parts(for_each, parts.size(), [&](size_t i) {
    const Part& part = parts[i];
    const RecordToApply& r = records[part.record];
    by_element_size<PatchOf>(r.element_size, r.target, decoded[part.record], part.first, part.last);
  });
}

DeltaHeader apply_delta(std::span<std::byte> target, size_t element_size, std::span<const uint8_t> record,
                        const std::string& what, const DeltaForEach& for_each) {
  RecordToApply r{target, element_size, record, what, {}};
  apply_delta({&r, 1}, for_each);
  return r.header;
}

}  // namespace refit
