#include "transport/local_socket/init_params.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <cmath>

#include "core/fail.h"
#include "refit/config.h"
#include "refit/config_keys.h"

namespace refit {

std::string InitParams::get(const std::string& key, const std::string& fallback) {
  known_[key] = true;
  auto it = params_.find(key);
  return it == params_.end() ? fallback : it->second;
}

double InitParams::seconds(const std::string& key, double fallback) {
  known_[key] = true;
  auto it = params_.find(key);
  if (it == params_.end()) return fallback;
  double value = 0;
  const std::string& text = it->second;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || !(value > 0) || !std::isfinite(value))
    fail(ErrorKind::kConfig,
         "refit_cfg.nixl.backend_init_params.{}: expected a positive, finite number of seconds, got '{}'", key, text);
  return value;
}

void InitParams::finish() const {
  const std::vector<std::string_view> accepted = config_key_names(ConfigScope::kBackendParam, backend_);
  for (const auto& [key, value] : known_)
    if (std::find(accepted.begin(), accepted.end(), key) == accepted.end())
      fail(ErrorKind::kInternal, "backend {} reads init param '{}', which the configuration table does not list",
           backend_, key);
  for (const auto& [key, value] : params_) {
    if (known_.count(key)) continue;
    fail(ErrorKind::kConfig, "refit_cfg.nixl.backend_init_params.{}: unknown parameter for backend {} (accepted: {})",
         key, backend_, fmt::join(accepted, ", "));
  }
}

Device parse_gpu_device_param(std::string_view backend, const std::string& text) {
  Device device = parse_device(text, "refit_cfg.nixl.backend_init_params.device");
  if (device.kind == Device::Kind::kCpu) {
    fail(ErrorKind::kConfig,
         "refit_cfg.nixl.backend_init_params.device: backend_name {} moves GPU memory and needs device cuda or cuda:N, "
         "got '{}'; use backend_name UCX for device=cpu",
         backend, text);
  }
  return device;
}

}  // namespace refit
