// What the CUDA IPC and NCCL backends share besides the control channel: the address blob a
// transport publishes (its control endpoint, host, process and GPU) and init-param parsing.
#pragma once

#include <map>
#include <span>
#include <string>
#include <string_view>

#include "refit/config.h"
#include "refit/transport.h"
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

// Init params of a backend, checked: get() marks a key as known; finish() throws Error(kConfig)
// naming any key nobody asked for, and the keys that are accepted.
class InitParams {
 public:
  InitParams(std::string backend, const std::map<std::string, std::string>& params)
      : backend_(std::move(backend)), params_(params) {}
  // The value of `key`, or `fallback` when absent.
  std::string get(const std::string& key, const std::string& fallback);
  // A positive, finite number of seconds (every wait has a deadline).
  double seconds(const std::string& key, double fallback);
  void finish() const;

 private:
  std::string backend_;
  std::map<std::string, std::string> params_;
  std::map<std::string, bool> known_;
};

// backend_init_params.device for a GPU backend: "cuda" or "cuda:N". Throws Error(kConfig) for a
// malformed value and for cpu ("backend_name CUDA_IPC moves GPU memory: ...").
Device parse_gpu_device_param(std::string_view backend, const std::string& text);

}  // namespace refit
