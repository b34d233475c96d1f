#include "transport/cuda_ipc/cuda_ipc_key.h"

#include "core/fail.h"
#include "core/wire.h"

namespace refit {
namespace {

constexpr std::string_view kKeyMagic = "RCIK";
constexpr uint8_t kKeyVersion = 1;

}  // namespace

Bytes encode_cuda_ipc_key(const CudaIpcRegionKey& key) {
  ByteWriter w;
  w.put_raw(kKeyMagic);
  w.put<uint8_t>(kKeyVersion);
  w.put<uint8_t>(key.exported ? 1 : 0);
  w.put_raw(key.handle);
  w.put<uint64_t>(key.offset);
  w.put_raw(key.owner);
  w.put_raw(key.process);
  w.put<int32_t>(key.device);
  return w.take();
}

CudaIpcRegionKey decode_cuda_ipc_key(std::span<const uint8_t> bytes, const std::string& label) {
  ByteReader r(bytes, "CUDA IPC region key of " + label);
  r.expect_magic(kKeyMagic);
  if (uint8_t version = r.get<uint8_t>("version"); version != kKeyVersion)
    fail(ErrorKind::kProtocol, "CUDA IPC region key of {} has version {}, this build speaks {}", label, version,
         kKeyVersion);
  CudaIpcRegionKey key;
  const auto exported = r.get<uint8_t>("exported");
  if (exported > 1) fail(ErrorKind::kProtocol, "malformed {}: field 'exported' is {}", r.what(), exported);
  key.exported = exported == 1;
  r.get_raw(key.handle, "IPC handle");
  key.offset = r.get<uint64_t>("offset");
  r.get_raw(key.owner, "owner");
  r.get_raw(key.process, "process");
  key.device = r.get<int32_t>("device");
  r.expect_end();
  return key;
}

}  // namespace refit
