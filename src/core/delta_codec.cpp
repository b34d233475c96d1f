#include "core/delta_codec.h"

#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cstring>

#include "core/fail.h"
#include "core/wire.h"

namespace refit {
namespace {

constexpr std::string_view kMagic = "RFD1";

// Bytes of the LEB128 varint of v.
size_t varint_size(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

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

// The indices of the elements that differ, stopping (and returning false) once keeping them would
// cost `budget` bytes or more (header, the cheaper of gaps and bitmap, values).
bool changed_elements(std::span<const std::byte> base, std::span<const std::byte> now, size_t element_size,
                      uint64_t budget, std::vector<uint64_t>& changed, uint64_t& gap_bytes) {
  const uint64_t elements = now.size() / element_size;
  const uint64_t bitmap_bytes = (elements + 7) / 8;
  uint64_t previous = 0;
  gap_bytes = 0;
  auto note = [&](uint64_t i) {
    gap_bytes += varint_size(changed.empty() ? i : i - previous - 1);
    previous = i;
    changed.push_back(i);
    return kDeltaHeaderBytes + std::min(gap_bytes, bitmap_bytes) + changed.size() * element_size < budget;
  };
  // Eight bytes at a time (element sizes divide 8): a word that differs names its elements by
  // which lanes of the XOR are non-zero; 64 bytes that all match are skipped with one test.
  const size_t lanes = 8 / element_size;
  const uint64_t lane_mask = element_size == 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * element_size)) - 1;
  const size_t words = now.size() / 8;
  const std::byte* a = base.data();
  const std::byte* b = now.data();
  auto word_changes = [&](size_t w) {
    const uint64_t x = load_word(a + w * 8) ^ load_word(b + w * 8);
    if (x == 0) return true;
    for (size_t lane = 0; lane < lanes; ++lane) {
      // Lane j of the word holds bytes [j * element_size, +element_size) in memory order.
      const unsigned shift = 8 * element_size * (std::endian::native == std::endian::little ? lane : lanes - 1 - lane);
      if (((x >> shift) & lane_mask) != 0 && !note(w * lanes + lane)) return false;
    }
    return true;
  };
  size_t w = 0;
  for (; w + 8 <= words; w += 8) {
    uint64_t any = 0;
    for (size_t k = 0; k < 8; ++k) any |= load_word(a + (w + k) * 8) ^ load_word(b + (w + k) * 8);
    if (any == 0) continue;
    for (size_t k = 0; k < 8; ++k)
      if (!word_changes(w + k)) return false;
  }
  for (; w < words; ++w)
    if (!word_changes(w)) return false;
  // The tail shorter than a word.
  for (uint64_t i = w * lanes; i < elements; ++i)
    if (std::memcmp(a + i * element_size, b + i * element_size, element_size) != 0 && !note(i)) return false;
  return true;
}

}  // namespace

uint64_t delta_checksum(std::span<const std::byte> bytes) { return XXH3_64bits(bytes.data(), bytes.size()); }

bool encode_delta(std::span<std::byte> base, std::span<const std::byte> now, size_t element_size, uint64_t checksum,
                  std::vector<uint8_t>& out) {
  if (element_size == 0 || base.size() != now.size() || now.size() % element_size != 0)
    fail(ErrorKind::kInternal, "encode_delta: {} and {} bytes of {}-byte elements", base.size(), now.size(),
         element_size);
  const uint64_t elements = now.size() / element_size;
  std::vector<uint64_t> changed;
  uint64_t gap_bytes = 0;
  if (!changed_elements(base, now, element_size, now.size(), changed, gap_bytes)) return false;
  const uint64_t bitmap_bytes = (elements + 7) / 8;
  const DeltaEncoding encoding =
      changed.empty() ? DeltaEncoding::kNone : (gap_bytes <= bitmap_bytes ? DeltaEncoding::kGaps : DeltaEncoding::kBitmap);
  const uint64_t positions =
      encoding == DeltaEncoding::kNone ? 0 : (encoding == DeltaEncoding::kGaps ? gap_bytes : bitmap_bytes);
  out.assign(kDeltaHeaderBytes + positions + changed.size() * element_size, 0);
  uint8_t* p = out.data();
  std::memcpy(p, kMagic.data(), kMagic.size());
  p += kMagic.size();
  p = put_le<uint8_t>(p, static_cast<uint8_t>(encoding));
  p = put_le<uint8_t>(p, static_cast<uint8_t>(element_size));
  p = put_le<uint16_t>(p, 0);
  p = put_le<uint64_t>(p, elements);
  p = put_le<uint64_t>(p, changed.size());
  p = put_le<uint64_t>(p, checksum);
  if (encoding == DeltaEncoding::kGaps) {
    uint64_t previous = 0;
    for (size_t k = 0; k < changed.size(); ++k) {
      p = put_varint(p, k == 0 ? changed[k] : changed[k] - previous - 1);
      previous = changed[k];
    }
  } else if (encoding == DeltaEncoding::kBitmap) {
    for (uint64_t i : changed) p[i / 8] |= static_cast<uint8_t>(1u << (i % 8));
    p += bitmap_bytes;
  }
  for (uint64_t i : changed) {
    std::memcpy(p, now.data() + i * element_size, element_size);
    std::memcpy(base.data() + i * element_size, now.data() + i * element_size, element_size);
    p += element_size;
  }
  return true;
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
  if (in.get<uint16_t>("reserved") != 0) fail(ErrorKind::kProtocol, "malformed {}: reserved bytes are set", what);
  h.elements = in.get<uint64_t>("elements");
  h.changed = in.get<uint64_t>("changed");
  h.checksum = in.get<uint64_t>("checksum");
  if (h.changed > h.elements)
    fail(ErrorKind::kProtocol, "malformed {}: {} changed of {} elements", what, h.changed, h.elements);
  if ((h.encoding == DeltaEncoding::kNone) != (h.changed == 0))
    fail(ErrorKind::kProtocol, "malformed {}: encoding {} with {} changed elements", what, encoding, h.changed);
  return h;
}

DeltaHeader apply_delta(std::span<std::byte> target, size_t element_size, std::span<const uint8_t> record,
                        const std::string& what) {
  const DeltaHeader h = read_delta_header(record, what);
  if (h.element_size != element_size || h.elements * element_size != target.size())
    fail(ErrorKind::kProtocol, "{} is for {} elements of {} bytes, but the tensor has {} bytes of {}-byte elements",
         what, h.elements, h.element_size, target.size(), element_size);
  const uint8_t* p = record.data() + kDeltaHeaderBytes;
  const uint8_t* end = record.data() + record.size();
  // The values are the record's last changed * element_size bytes; positions lie before them.
  const uint64_t value_bytes = h.changed * element_size;
  if (static_cast<uint64_t>(end - p) < value_bytes)
    fail(ErrorKind::kProtocol, "malformed {}: {} bytes cannot hold {} values", what, end - p, h.changed);
  const uint8_t* values = end - value_bytes;
  std::vector<uint64_t> index;
  index.reserve(h.changed);
  if (h.encoding == DeltaEncoding::kGaps) {
    uint64_t previous = 0;
    for (uint64_t k = 0; k < h.changed; ++k) {
      uint64_t gap = 0;
      for (int shift = 0;; shift += 7) {
        if (p >= values || shift > 63) fail(ErrorKind::kProtocol, "malformed {}: position {} is cut off", what, k);
        const uint8_t byte = *p++;
        gap |= static_cast<uint64_t>(byte & 0x7f) << shift;
        if (!(byte & 0x80)) break;
      }
      const uint64_t i = k == 0 ? gap : previous + 1 + gap;
      if (i >= h.elements || (k > 0 && i <= previous))
        fail(ErrorKind::kProtocol, "malformed {}: position {} is element {} of {}", what, k, i, h.elements);
      index.push_back(i);
      previous = i;
    }
  } else if (h.encoding == DeltaEncoding::kBitmap) {
    const uint64_t bitmap_bytes = (h.elements + 7) / 8;
    if (static_cast<uint64_t>(values - p) < bitmap_bytes)
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
  if (p != values) fail(ErrorKind::kProtocol, "malformed {}: {} bytes between positions and values", what, values - p);
  for (uint64_t k = 0; k < index.size(); ++k)
    std::memcpy(target.data() + index[k] * element_size, values + k * element_size, element_size);
  return h;
}

}  // namespace refit
