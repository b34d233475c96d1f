// What the CUDA IPC and NCCL backends share besides the control channel: the address blob a
// transport publishes (its control endpoint, host, process and GPU).
#pragma once

#include <map>
#include <span>
#include <string>
#include <string_view>

#include "refit/config.h"
#include "refit/ext/transport.h"
#include "transport/local_socket/local_socket.h"

namespace refit {

struct LocalPeerAddress {
  EndpointId endpoint{};   // the control endpoint's id (its socket name derives from it)
  LocalIdentity identity;  // host, process token, pid
  int device = -1;         // CUDA device index in the owner's numbering (for messages)
  std::string bus_id;      // PCI bus id of that GPU ("0000:19:00.0"), "" when unknown
};

// Layout: 4-byte magic (per backend), u8 version, endpoint id, process token, u32 pid, host,
// i32 device, bus id (strings as u32 length + bytes).
Bytes encode_local_peer_address(std::string_view magic, const LocalPeerAddress& address);
// Throws Error(kProtocol) naming `label` and `backend` when the blob is not one that
// encode_local_peer_address wrote with this magic (e.g. a UCX address given to CUDA_IPC).
LocalPeerAddress decode_local_peer_address(std::string_view magic, std::string_view backend,
                                           std::span<const uint8_t> blob, const std::string& label);

}  // namespace refit
