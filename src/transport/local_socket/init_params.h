// The init params of the backends over the local control channel (CUDA IPC, NCCL), checked
// against the configuration table (config_keys.h).
#pragma once

#include <map>
#include <string>
#include <string_view>

#include "refit/config.h"

namespace refit {

// get() and seconds() mark a key as read; finish() throws Error(kConfig) naming any key given
// that nobody read, with the keys the table accepts for the backend, and Error(kInternal) for a
// key read that the table does not list.
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
