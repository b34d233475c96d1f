// What the NCCL backend's peers send each other besides messages, encoded with the wire codec
// (core/wire.h): its address (a local peer address, local_peer.h, with magic kNcclAddressMagic),
// the region key of describe(), the communicator setup message, read requests to a region's
// owner and its error replies. Compiled without CUDA or NCCL, so that tests and the fuzz target
// fuzz/fuzz_nccl_request.cpp reach every decoder on any machine. Each decoder throws
// Error(kProtocol) "malformed <what it decodes> of/from <peer>: ..." for anything its encoder did
// not write.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "refit/ext/transport.h"
#include "transport/local_socket/local_socket.h"

namespace refit {

inline constexpr std::string_view kNcclAddressMagic = "RFNC";
// The bytes of an ncclUniqueId (NCCL_UNIQUE_ID_BYTES), opaque to refit.
inline constexpr size_t kNcclUniqueIdBytes = 128;
using NcclUniqueIdBytes = std::array<uint8_t, kNcclUniqueIdBytes>;

// RemoteRegion::key: magic "RNCK", u8 version, owner endpoint id (16 bytes), u64 region id.
struct NcclRegionKey {
  EndpointId owner{};
  uint64_t region = 0;
};
Bytes encode_nccl_key(const NcclRegionKey& key);
NcclRegionKey decode_nccl_key(std::span<const uint8_t> bytes, const std::string& label);

// From the pair's rank 0 to rank 1 (control channel kSetup): u64 connection generation, the
// communicator's unique id (128 bytes).
struct NcclSetup {
  uint64_t generation = 0;
  NcclUniqueIdBytes id{};
};
Bytes encode_nccl_setup(const NcclSetup& setup);
NcclSetup decode_nccl_setup(std::span<const uint8_t> bytes, const std::string& label);

// A read request to the region's owner (kRequest): u64 request id, region id, offset, length.
struct NcclReadRequest {
  uint64_t id = 0;
  uint64_t region = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};
Bytes encode_nccl_request(const NcclReadRequest& request);
NcclReadRequest decode_nccl_request(std::span<const uint8_t> bytes, const std::string& from);

// The owner's refusal of a request (kReply): u64 request id, the reason (u32 length + bytes).
struct NcclReply {
  uint64_t request = 0;
  std::string error;
};
Bytes encode_nccl_reply(const NcclReply& reply);
NcclReply decode_nccl_reply(std::span<const uint8_t> bytes, const std::string& from);

}  // namespace refit
