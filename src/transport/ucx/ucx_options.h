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
  // As UCX's environment names it without the "UCX_" prefix: "TLS", "KEEPALIVE_INTERVAL", "TCP_SNDBUF".
  std::string name;
  std::string value;
  std::string param;  // the init param it came from, for error messages; empty for refit's defaults
  // The name this UCX library matches it by: `name`, but UCX < 1.17 matches a transport's settings
  // by their name inside the transport's table ("SNDBUF" for UCX_TCP_SNDBUF); see ucx_setting_name().
  std::string ucx_name = {};
  // A default that a UCX without this setting simply goes without (it only makes a feature faster).
  bool optional = false;
};

struct UcxOptions {
  ucp_err_handling_mode_t error_mode = UCP_ERR_HANDLING_MODE_PEER;
  std::vector<UcxSetting> settings;  // applied in order, so a later setting wins
};

// Throws Error(kConfig) naming refit_cfg.nixl.backend_init_params.<key> and its value.
// `gpu_buffers`: the transport moves GPU memory (device cuda), which adds refit's defaults for it.
UcxOptions parse_ucx_options(const std::map<std::string, std::string>& params, bool gpu_buffers = false);

// The name under which this UCX library takes the setting that its environment calls
// "UCX_<name>". UCX 1.17 and later match transport settings by that name (TCP_SNDBUF; 1.21 and
// later reject names that no component defines); before 1.17 UCX matched them by their name
// inside the transport's configuration table (SNDBUF), or inside the settings group the
// transport shares with others (MM_FIFO_SIZE for UCX_POSIX_FIFO_SIZE, which then reaches sysv
// too), and ignored the environment's name. For those versions this returns that older name;
// otherwise, and for names no transport table explains (UCP's own, "MM_FIFO_SIZE"), `name`.
std::string ucx_setting_name(const std::string& name);

struct UcpConfigDeleter {
  void operator()(ucp_config_t* config) const { ucp_config_release(config); }
};
using UcpConfig = std::unique_ptr<ucp_config_t, UcpConfigDeleter>;

// The environment's UCX configuration with `options.settings` applied on top. Throws
// Error(kConfig) for a value UCX rejects.
UcpConfig make_ucp_config(const UcxOptions& options);

// UCX hands settings that are not UCP's own to the transports as they open (in
// ucp_worker_create). Before 1.21 it only warns about those that no transport took: a typo, a
// setting of a transport not in use, or a value the transport rejects. While alive, this captures
// that warning on the calling thread; check() then throws Error(kConfig) if it names a setting from
// engine_config (refit's own defaults may go unused, e.g. shared memory settings with tls=tcp).
// UCX 1.21 and later reject an unknown name in ucp_config_modify (make_ucp_config throws) and
// skip a setting that a transport in use rejects without a warning: nothing to capture then.
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
