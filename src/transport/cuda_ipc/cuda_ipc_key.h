// What the CUDA IPC backend's peers send each other besides messages: its address (a local peer
// address, local_peer.h, with magic kCudaIpcAddressMagic) and the region key that describe()
// puts in RemoteRegion::key, which a reader decodes before it maps anything. Encoded with the
// wire codec (core/wire.h) and compiled without CUDA, so that tests and the fuzz target
// fuzz/fuzz_cuda_ipc_key.cpp reach the decoder on any machine.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "refit/ext/transport.h"
#include "transport/local_socket/local_socket.h"

namespace refit {

inline constexpr std::string_view kCudaIpcAddressMagic = "RFCI";
// The bytes of a cudaIpcMemHandle_t (CUDA_IPC_HANDLE_SIZE), opaque to refit.
inline constexpr size_t kIpcHandleBytes = 64;
using IpcHandleBytes = std::array<uint8_t, kIpcHandleBytes>;

// Layout: magic "RCIK", u8 version, u8 exported (0 or 1), the IPC handle (64 bytes), u64 offset,
// owner endpoint id (16 bytes), owner process token (16 bytes), i32 device.
struct CudaIpcRegionKey {
  bool exported = false;    // device memory with an IPC handle (false: host memory, or empty)
  IpcHandleBytes handle{};  // of the whole allocation
  uint64_t offset = 0;      // of the region inside that allocation
  EndpointId owner{};       // the owner's control endpoint
  EndpointId process{};     // the owner's process token
  int32_t device = -1;      // the GPU of the memory, in the owner's numbering
};

Bytes encode_cuda_ipc_key(const CudaIpcRegionKey& key);
// Throws Error(kProtocol) "malformed CUDA IPC region key of <label>: ..." (or naming its version)
// for anything encode_cuda_ipc_key did not write.
CudaIpcRegionKey decode_cuda_ipc_key(std::span<const uint8_t> bytes, const std::string& label);

}  // namespace refit
