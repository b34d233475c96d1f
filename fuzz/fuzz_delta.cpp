// apply_delta on arbitrary records, as a destination applies the changes a source sent
// (delta/codec.h). The first input byte picks the element size (1, 2, 4 or 8) and the
// tensor's element count comes from the record's own header when it is small, so that inputs
// reach the position decoders. Oracles: only Error(kProtocol) may come out, and a refused record
// writes nothing; an accepted one changes exactly `changed` elements at most, and encoding the
// tensor before and after again gives a record that applies to the same result, both by the
// host's scan and from the changes as a GPU kernel compacts them (encode_delta_changes).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "delta/codec.h"
#include "fuzz_common.h"

using namespace refit;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const size_t element_size = size_t{1} << (data[0] % 4);
  const std::span<const uint8_t> record(data + 1, size - 1);
  uint64_t elements = 64;
  if (record.size() >= 16) {
    uint64_t declared = 0;
    std::memcpy(&declared, record.data() + 8, 8);  // little-endian hosts only: a hint, not a check
    if (declared <= 4096) elements = declared;
  }
  std::vector<std::byte> old(elements * element_size);
  for (size_t i = 0; i < old.size(); ++i) old[i] = static_cast<std::byte>(i * 7 + 3);
  std::vector<std::byte> target = old;
  DeltaHeader h;
  try {
    h = apply_delta(target, element_size, record, "changes to 'w' from source rank 0");
  } catch (const Error& e) {
    FUZZ_EXPECT_ERROR(e, ErrorKind::kProtocol, "'w' from source rank 0");
    FUZZ_CHECK(target == old);
    return 0;
  }
  uint64_t differ = 0;
  for (uint64_t i = 0; i < elements; ++i)
    differ += std::memcmp(old.data() + i * element_size, target.data() + i * element_size, element_size) != 0;
  FUZZ_CHECK(differ <= h.changed);
  std::vector<std::byte> base = old, again = old;
  std::vector<uint8_t> encoded;
  if (encode_delta(base, target, element_size, encoded).encoded) {
    FUZZ_CHECK(base == target);
    const DeltaHeader h2 = apply_delta(again, element_size, encoded, "re-encoded changes");
    FUZZ_CHECK(again == target);
    FUZZ_CHECK(h2.changed == differ);
  }
  std::vector<uint64_t> index, before, after;
  for (uint64_t i = 0; i < elements; ++i) {
    uint64_t a = 0, b = 0;
    std::memcpy(&a, old.data() + i * element_size, element_size);  // little-endian hosts
    std::memcpy(&b, target.data() + i * element_size, element_size);
    if (a == b) continue;
    index.push_back(i);
    before.push_back(a);
    after.push_back(b);
  }
  const uint64_t checksum = delta_checksum(target, DeltaChecksum::kWords);
  std::vector<uint8_t> made;
  if (encode_delta_changes(elements, element_size, index, before, after, DeltaChecksum::kWords, checksum, made)) {
    std::vector<std::byte> patched = old;
    const DeltaHeader h3 = apply_delta(patched, element_size, made, "changes from a kernel");
    FUZZ_CHECK(patched == target);
    FUZZ_CHECK(h3.checksum == delta_checksum(patched, h3.checksum_kind));
  }
  return 0;
}
