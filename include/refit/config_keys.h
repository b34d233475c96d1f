// refit's configuration table: every key of the refit_cfg.nixl scope, every transport backend's
// init params and every environment variable refit reads, with its type, default and meaning.
// The parser and to_yaml (config.h) go by its nixl rows, the backends name their accepted params
// from it, and `refit info --config`, the Python package (refit.config_keys()) and the docs check
// read it: a key exists in all of them or in none.
#pragma once

#include <span>
#include <string_view>
#include <vector>

namespace refit {

enum class ConfigScope {
  kNixl,          // refit_cfg.nixl.<name>
  kBackendParam,  // refit_cfg.nixl.backend_init_params.<name>, for the backends in `backends`
  kEnvironment,   // an environment variable
};

std::string_view to_string(ConfigScope scope);  // "nixl", "backend_init_params", "environment"

struct ConfigKey {
  ConfigScope scope = ConfigScope::kNixl;
  std::string_view name;
  std::string_view type;  // "bool", "number", "string", "byte count or null", ...
  // As the value is written: the YAML to_yaml() writes for RefitConfig{} (nixl keys), else the
  // value used when the param or variable is absent ("" when there is none).
  std::string_view default_value;
  std::string_view backends;  // kBackendParam: the backends that take it, "UCX" or "CUDA_IPC NCCL"
  bool extension = false;     // kNixl: refit's own key, not the reference's
  std::string_view summary;   // one line; docs/CONFIG.md says the rest
};

// Every row: nixl keys in the order to_yaml() writes them, then backend params, then variables.
std::span<const ConfigKey> config_keys();

// The names of one scope's rows; for kBackendParam with a `backend`, only those it takes (any case).
std::vector<std::string_view> config_key_names(ConfigScope scope, std::string_view backend = {});

}  // namespace refit
