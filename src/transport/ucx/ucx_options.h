// The UCX backend's init params, validated and turned into UCP configuration settings.
#pragma once

#include <ucp/api/ucp.h>
#include <ucs/debug/log_def.h>

#include <cstdarg>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace refit {

struct UcxSetting {
  std::string name;  // UCP configuration name without the "UCX_" prefix: "TLS", "KEEPALIVE_INTERVAL"
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

// UCX hands settings that are not UCP's own to the transports as they open (in
// ucp_worker_create) and only warns about those that no transport took: a typo, a setting of a
// transport not in use, or a value the transport rejects. While alive, this captures that warning
// on the calling thread; check() then throws Error(kConfig) if it names a setting from
// engine_config (refit's own defaults may go unused, e.g. shared memory settings with tls=tcp).
class UnusedUcxSettings {
 public:
  explicit UnusedUcxSettings(const UcxOptions& options);
  ~UnusedUcxSettings();
  UnusedUcxSettings(const UnusedUcxSettings&) = delete;
  UnusedUcxSettings& operator=(const UnusedUcxSettings&) = delete;

  void check() const;

 private:
  static ucs_log_func_rc_t on_log(const char* file, unsigned line, const char* function, ucs_log_level_t level,
                                  const ucs_log_component_config_t* component, const char* format, va_list args);

  const UcxOptions& options_;
  std::string warnings_;
};

// "refit_cfg.nixl.backend_init_params.<key>", the name users see for an init param.
std::string ucx_param_name(const std::string& key);

}  // namespace refit
