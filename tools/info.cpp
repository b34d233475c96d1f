#include "info.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <optional>

#include "refit/config.h"
#include "refit/config_keys.h"
#include "refit/device.h"
#include "refit/ext/transport.h"
#include "refit/memory.h"
#include "refit/version.h"

namespace refit::tools {

namespace {

int print_keys(bool json) {
  if (json) {
    auto rows = nlohmann::json::array();
    for (const ConfigKey& key : config_keys()) {
      nlohmann::json row = {{"scope", to_string(key.scope)},
                            {"name", key.name},
                            {"type", key.type},
                            {"default", key.default_value},
                            {"summary", key.summary}};
      if (key.scope == ConfigScope::kBackendParam) row["backends"] = key.backends;
      if (key.scope == ConfigScope::kNixl) row["extension"] = key.extension;
      rows.push_back(std::move(row));
    }
    fmt::print("{}\n", rows.dump(1));
    return 0;
  }
  // Columns as wide as their widest entry.
  size_t name_width = 0, type_width = 0, default_width = 4;  // "none"
  for (const ConfigKey& key : config_keys()) {
    name_width = std::max(name_width, key.name.size());
    type_width = std::max(type_width, key.type.size());
    default_width = std::max(default_width, key.default_value.size());
  }
  std::optional<ConfigScope> scope;
  for (const ConfigKey& key : config_keys()) {
    if (key.scope != scope) {
      fmt::print("{}{}\n", scope ? "\n" : "",
                 key.scope == ConfigScope::kNixl           ? "refit_cfg.nixl"
                 : key.scope == ConfigScope::kBackendParam ? "refit_cfg.nixl.backend_init_params"
                                                           : "environment");
      scope = key.scope;
    }
    const std::string where = key.scope == ConfigScope::kBackendParam ? fmt::format(" [{}]", key.backends)
                              : key.extension                         ? " [refit]"
                                                                      : "";
    fmt::print("  {:<{}}  {:<{}}  default {:<{}}  {}{}\n", key.name, name_width, key.type, type_width,
               key.default_value.empty() ? "none" : key.default_value, default_width, key.summary, where);
  }
  return 0;
}

}  // namespace

int run_info(const InfoOptions& options) {
  if (options.keys) return print_keys(options.json);
  const RefitConfig config = load_config(options.config_file, options.overrides);
  fmt::print("refit        {}\n", kVersionString);
  fmt::print("host memory  {:.2f} GiB\n", total_host_memory_bytes() / double(1ull << 30));
  std::string no_gpu;
  const int gpus = cuda_device_count(&no_gpu);
  if (!cuda_built())
    fmt::print("CUDA         not in this build (REFIT_WITH_CUDA=OFF or no toolkit at build time): device cpu only\n");
  else if (gpus > 0)
    fmt::print("CUDA         built; {} GPU(s) seen, the first with {:.2f} GiB\n", gpus,
               total_device_memory_bytes(Device{Device::Kind::kCuda, 0}) / double(1ull << 30));
  else
    fmt::print("CUDA         built; no usable GPU: {}\n", no_gpu);
  fmt::print("transports\n");
  for (const auto& backend : transport_backends())
    fmt::print("  {:<10} {:<12} {}\n", backend.name, backend.available ? "available" : "unavailable", backend.detail);
  fmt::print("effective configuration{}:\n{}", options.config_file.empty() ? " (defaults and overrides)" : "",
             to_yaml(config));
  return 0;
}

}  // namespace refit::tools
