// refit's wrapper around a UCX worker address (src/transport/ucx/ucx_address.cpp) on arbitrary
// bytes, as UcxTransport::connect decodes a peer's address from its metadata, and the same bytes
// as the header of a control message (the sender's instance id). UCX itself is not linked: the
// worker address inside stays opaque bytes.
// Oracles: only Error(kProtocol) naming the peer (or the header) may come out; an accepted address
// is non-empty and re-encodes to exactly the input bytes; an accepted header is the 16 input bytes.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "fuzz_common.h"
#include "transport/ucx/ucx_address.h"

using namespace refit;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> in(data, size);
  try {
    const UcxAddress address = decode_ucx_address(in, "source rank 0");
    FUZZ_CHECK(!address.worker_address.empty());
    const Bytes again = encode_ucx_address(address.id, address.process, address.peer_errors, address.worker_address);
    FUZZ_CHECK(again.size() == size && std::equal(again.begin(), again.end(), data));
  } catch (const Error& e) {
    FUZZ_EXPECT_ERROR(e, ErrorKind::kProtocol, "source rank 0");
  }
  try {
    const InstanceId sender = decode_ucx_message_header(in);
    FUZZ_CHECK(size == sender.size() && std::equal(sender.begin(), sender.end(), data));
  } catch (const Error& e) {
    FUZZ_EXPECT_ERROR(e, ErrorKind::kProtocol, "UCX message header");
  }
  return 0;
}
