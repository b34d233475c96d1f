// The UCX backend's init params, validated and turned into UCP configuration settings.
#pragma once

#include <ucp/api/ucp.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace refit {

struct UcxSetting {
  std::string name;   // UCP configuration name without the "UCX_" prefix: "TLS", "KEEPALIVE_INTERVAL"
  std::string value;
  std::string param;  // the init param it came from, for error messages; empty for refit's defaults
};

struct UcxOptions {
  ucp_err_handling_mode_t error_mode = UCP_ERR_HANDLING_MODE_PEER;
  std::vector<UcxSetting> settings;  // applied in order, so a later setting wins
};

// Throws Error(kConfig) naming refit_cfg.nixl.backend_init_params.<key> and its value.
UcxOptions parse_ucx_options(const std::map<std::string, std::string>& params);

struct UcpConfigDeleter {
  void operator()(ucp_config_t* config) const { ucp_config_release(config); }
};
using UcpConfig = std::unique_ptr<ucp_config_t, UcpConfigDeleter>;

// The environment's UCX configuration with `options.settings` applied on top. Throws
// Error(kConfig) for a value UCX rejects.
UcpConfig make_ucp_config(const UcxOptions& options);

// UCX accepts any name for transport-level settings and ignores unknown ones; this rejects
// settings that no loaded UCX component defines (a typo in engine_config). Call after ucp_init,
// which loads the transport modules.
void check_ucx_settings_known(const UcxOptions& options);

// "refit_cfg.nixl.backend_init_params.<key>", the name users see for an init param.
std::string ucx_param_name(const std::string& key);

}  // namespace refit
