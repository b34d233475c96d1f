// The NCCL backend's decoders (src/transport/nccl/nccl_wire.cpp) on arbitrary bytes, each on the
// whole input: a read request (what a region's owner decodes on its control thread), the region
// key, the communicator setup message and the owner's reply. Decoding only: no CUDA or NCCL.
// Oracles: only Error(kProtocol) naming the peer may come out; whatever a decoder accepts
// re-encodes to exactly the input bytes.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "fuzz_common.h"
#include "transport/nccl/nccl_wire.h"

using namespace refit;

namespace {

template <typename Decode, typename Encode>
void round_trip(std::span<const uint8_t> in, Decode decode, Encode encode) {
  try {
    const Bytes again = encode(decode(in, "endpoint 00ff"));
    FUZZ_CHECK(again.size() == in.size() && std::equal(again.begin(), again.end(), in.begin()));
  } catch (const Error& e) {
    FUZZ_EXPECT_ERROR(e, ErrorKind::kProtocol, "endpoint 00ff");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> in(data, size);
  round_trip(in, decode_nccl_request, encode_nccl_request);
  round_trip(in, decode_nccl_key, encode_nccl_key);
  round_trip(in, decode_nccl_setup, encode_nccl_setup);
  round_trip(in, decode_nccl_reply, encode_nccl_reply);
  return 0;
}
