// decode_cuda_ipc_key (src/transport/cuda_ipc/cuda_ipc_key.cpp) on arbitrary bytes: the region
// key a CUDA IPC peer puts in RemoteRegion::key (IPC handle, offset, owner), which a reader
// decodes before it maps anything. Decoding only: no CUDA runtime is involved.
// Oracles: only Error(kProtocol) naming the peer may come out; an accepted key re-encodes to
// exactly the input bytes.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "fuzz_common.h"
#include "transport/cuda_ipc/cuda_ipc_key.h"

using namespace refit;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const CudaIpcRegionKey key = decode_cuda_ipc_key(std::span<const uint8_t>(data, size), "source rank 0");
    const Bytes again = encode_cuda_ipc_key(key);
    FUZZ_CHECK(again.size() == size && std::equal(again.begin(), again.end(), data));
  } catch (const Error& e) {
    FUZZ_EXPECT_ERROR(e, ErrorKind::kProtocol, "source rank 0");
  }
  return 0;
}
