// decode_local_peer_address (src/transport/local_socket/local_peer.cpp) on arbitrary bytes, as
// the CUDA IPC and NCCL backends decode a peer's address from its metadata, with each backend's
// magic.
// Oracles: only Error(kProtocol) naming the peer may come out; an accepted address re-encodes to
// exactly the input bytes.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "fuzz_common.h"
#include "transport/cuda_ipc/cuda_ipc_key.h"
#include "transport/local_socket/local_peer.h"
#include "transport/nccl/nccl_wire.h"

using namespace refit;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> blob(data, size);
  const std::pair<std::string_view, std::string_view> backends[] = {{kCudaIpcAddressMagic, "CUDA_IPC"},
                                                                    {kNcclAddressMagic, "NCCL"}};
  for (const auto& [magic, backend] : backends) {
    try {
      const LocalPeerAddress address = decode_local_peer_address(magic, backend, blob, "source rank 0");
      const Bytes again = encode_local_peer_address(magic, address);
      FUZZ_CHECK(again.size() == size && std::equal(again.begin(), again.end(), data));
    } catch (const Error& e) {
      FUZZ_EXPECT_ERROR(e, ErrorKind::kProtocol, "source rank 0");
    }
  }
  return 0;
}
