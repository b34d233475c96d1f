// decode_safetensors_header (src/core/safetensors.cpp) on arbitrary bytes as a whole safetensors
// file (8-byte little-endian header length, JSON header, data), as SafetensorsFile decodes a
// mapped file that another process wrote.
// Oracles: only Error(kModel) naming the file may come out; for an accepted header, every
// tensor's dtype x shape is exact in 128-bit arithmetic, its data lies inside the file after the
// header, tensors come in offset order and the non-empty ones do not overlap.
#include <cstddef>
#include <cstdint>
#include <span>

#include "core/safetensors_header.h"
#include "fuzz_common.h"

using namespace refit;
using u128 = unsigned __int128;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  SafetensorsHeader header;
  try {
    header = decode_safetensors_header(std::span<const uint8_t>(data, size), "fuzz.safetensors");
  } catch (const Error& e) {
    FUZZ_EXPECT_ERROR(e, ErrorKind::kModel, "fuzz.safetensors");
    return 0;
  }
  FUZZ_CHECK(size >= 8);
  FUZZ_CHECK(header.tensors.size() == header.offsets.size());
  uint64_t header_end = 0;
  for (int i = 0; i < 8; ++i) header_end |= uint64_t{data[i]} << (8 * i);
  header_end += 8;
  FUZZ_CHECK(header_end <= size);
  uint64_t previous_end = header_end;
  uint64_t previous_begin = header_end;
  for (size_t i = 0; i < header.tensors.size(); ++i) {
    const TensorInfo& t = header.tensors[i];
    u128 nbytes = dtype_size(t.dtype);
    for (int64_t d : t.shape) {
      FUZZ_CHECK(d >= 0);
      nbytes *= static_cast<uint64_t>(d);
      FUZZ_CHECK(nbytes <= UINT64_MAX);
    }
    FUZZ_CHECK(t.nbytes() == static_cast<uint64_t>(nbytes));
    const uint64_t begin = header.offsets[i];
    FUZZ_CHECK(begin >= header_end && begin <= size && nbytes <= size - begin);
    FUZZ_CHECK(begin >= previous_begin);
    if (nbytes > 0) {
      FUZZ_CHECK(begin >= previous_end);
      previous_end = begin + static_cast<uint64_t>(nbytes);
    }
    previous_begin = begin;
  }
  return 0;
}
