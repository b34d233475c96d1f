// protocol::decode_metadata on arbitrary bytes, as init_source/init_destination decode every
// peer's metadata blob; then decode_layout on the layout it carries, as a source does.
// Oracles: only Error(kProtocol) may come out; an accepted blob re-encodes to the same bytes and
// satisfies what decode_metadata promises (version, two buffers each holding a bucket), and its
// re-encoding decodes again to the same encoding (encode o decode is a fixed point).
#include <cstddef>
#include <cstdint>
#include <span>

#include "engine/protocol.h"
#include "fuzz_common.h"
#include "refit/layout.h"

using namespace refit;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> in(data, size);
  protocol::EngineMetadata m;
  try {
    m = protocol::decode_metadata(in, "metadata of source rank 0");
  } catch (const Error& e) {
    FUZZ_EXPECT_PROTOCOL_ERROR(e);
    return 0;
  }
  FUZZ_CHECK(m.version == protocol::kVersion);
  FUZZ_CHECK(m.buffers.length == 0 || m.buffers.length / 2 >= m.bucket_bytes);
  const Bytes again = protocol::encode(m);
  FUZZ_CHECK(again.size() == size);  // every field has a fixed or length-prefixed size
  try {
    FUZZ_CHECK(protocol::encode(protocol::decode_metadata(again, "re-encoded metadata")) == again);
  } catch (const Error& e) {
    std::fprintf(stderr, "fuzz: re-encoded metadata does not decode: %s\n", e.what());
    std::abort();
  }
  if (!m.layout.empty()) {
    try {
      decode_layout(m.layout, "layout of destination rank 0");
    } catch (const Error& e) {
      FUZZ_EXPECT_PROTOCOL_ERROR(e);
    }
  }
  return 0;
}
