// The UCX backend: one UCP worker per transport with a progress thread, one-sided GET for
// read(), active messages for send()/receive(), peer error handling for lost peers.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "refit/ext/transport.h"

namespace refit {

// Accepted init params (all values are strings, as the reference passes them):
//   ucx_error_handling_mode: "peer" (default) | "none"
//   device_list:   comma-separated UCX devices (UCX_NET_DEVICES)
//   tls:           comma-separated UCX transports (UCX_TLS)
//   engine_config: "KEY=VALUE[;KEY=VALUE...]" applied to the UCP config, KEY named as in UCX's
//                  environment ("TCP_SNDBUF" or "UCX_TCP_SNDBUF") on every UCX version
//                  (ucx_setting_name() translates it for UCX < 1.17)
// Throws Error(kConfig) naming the key for anything else.
// `gpu_buffers`: its buffers will be GPU memory (parse_ucx_options).
std::unique_ptr<Transport> create_ucx_transport(const std::map<std::string, std::string>& init_params,
                                                bool gpu_buffers = false);

// What UCX, configured by these init params, offers here: its version, its transports
// ("tcp/eth0", "posix/memory"), the memory types it moves, and whether CUDA memory is among them
// (a UCX built with CUDA, its cuda transports selected, and a GPU driver present). Throws
// Error(kConfig) for bad params as above; `error` says why a context could not be made.
struct UcxCapabilities {
  std::string version;
  std::vector<std::string> transports;
  std::vector<std::string> memory_types;
  bool cuda = false;
  std::string error;
};
UcxCapabilities ucx_capabilities(const std::map<std::string, std::string>& init_params);

}  // namespace refit
