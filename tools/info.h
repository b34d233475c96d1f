// `refit info`: what refit finds on this machine and in this build (version, GPUs, each transport
// backend and why one is unavailable, UCX's transports and memory types), and the configuration
// that a run with the same config file and overrides would use. `--keys`: the configuration table
// instead (config_keys.h), as text or, with `--json`, as JSON.
#pragma once

#include <string>
#include <vector>

namespace refit::tools {

struct InfoOptions {
  std::string config_file;
  std::vector<std::string> overrides;
  bool keys = false;
  bool json = false;
};

int run_info(const InfoOptions& options);

}  // namespace refit::tools
