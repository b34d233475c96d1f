// decode_layout on arbitrary bytes, as a source decodes the layout in a destination's metadata.
// Oracles: only Error(kProtocol) may come out; an accepted layout satisfies the decoder's bounds
// and survives encode -> decode unchanged (the bytes may differ: entries are re-encoded sorted
// by name); request_for answers for every listed name.
#include <cstddef>
#include <cstdint>
#include <span>

#include "fuzz_common.h"
#include "refit/layout.h"

using namespace refit;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Layout layout;
  try {
    layout = decode_layout(std::span<const uint8_t>(data, size), "layout of destination rank 0");
  } catch (const Error& e) {
    FUZZ_EXPECT_PROTOCOL_ERROR(e);
    return 0;
  }
  FUZZ_CHECK(layout.fallback == Take::kWhole || layout.fallback == Take::kDrop);
  for (const auto& p : layout.drop_prefixes) FUZZ_CHECK(!p.empty() && p.size() <= 4096);
  for (const auto& [name, req] : layout.tensors) {
    FUZZ_CHECK(!name.empty() && name.size() <= 4096);
    FUZZ_CHECK(req.take == Take::kWhole || req.take == Take::kSlice || req.take == Take::kDrop);
    if (req.take == Take::kSlice) {
      FUZZ_CHECK(req.slice.dim >= 0 && req.slice.start >= 0 && req.slice.length >= 0);
      FUZZ_CHECK(req.slice.length <= INT64_MAX - req.slice.start);
    }
    FUZZ_CHECK(layout.request_for(name) == req);
  }
  const auto bytes = encode_layout(layout);
  Layout again;
  try {
    again = decode_layout(bytes, "re-encoded layout");
  } catch (const Error& e) {
    std::fprintf(stderr, "fuzz: a decoded layout does not decode after encoding: %s\n", e.what());
    std::abort();
  }
  FUZZ_CHECK(again == layout);
  return 0;
}
