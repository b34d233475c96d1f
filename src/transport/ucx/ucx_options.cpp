#include "transport/ucx/ucx_options.h"

#include <ucs/config/parser.h>
#include <ucs/datastruct/list.h>
#include <uct/api/uct.h>

#include <fmt/ranges.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string_view>

#include "core/fail.h"
#include "refit/config_keys.h"

namespace refit {
namespace {

std::string_view trim(std::string_view text) {
  const char* blanks = " \t\r\n";
  size_t first = text.find_first_not_of(blanks);
  if (first == std::string_view::npos) return {};
  return text.substr(first, text.find_last_not_of(blanks) - first + 1);
}

// "KEY=VALUE;KEY=VALUE" with keys named as in UCX's environment minus the "UCX_" prefix.
void parse_engine_config(const std::string& text, std::vector<UcxSetting>& settings) {
  std::string_view rest = text;
  while (!rest.empty()) {
    size_t end = rest.find(';');
    std::string_view item = trim(rest.substr(0, end));
    rest = end == std::string_view::npos ? std::string_view{} : rest.substr(end + 1);
    if (item.empty()) continue;
    size_t equals = item.find('=');
    std::string_view key = trim(item.substr(0, equals));
    if (equals == std::string_view::npos || key.empty()) {
      fail(ErrorKind::kConfig, "{}='{}': '{}' is not KEY=VALUE", ucx_param_name("engine_config"), text, item);
    }
    if (key.starts_with("UCX_")) key.remove_prefix(4);
    settings.push_back({std::string(key), std::string(trim(item.substr(equals + 1))), "engine_config"});
  }
}

bool user_sets(const std::vector<UcxSetting>& settings, const std::string& name) {
  return std::getenv(("UCX_" + name).c_str()) != nullptr ||
         std::any_of(settings.begin(), settings.end(), [&](const UcxSetting& s) { return s.name == name; });
}

thread_local UnusedUcxSettings* capturing = nullptr;

// The name under which UCX < 1.17 matches `field` in `table`: a field of the table itself by its
// bare name, one of a settings group included in it (its field names "MM_", "SM_" or "", for
// settings that several transports share) by the outermost group's prefix and its bare name.
std::optional<std::string> legacy_field_name(const ucs_config_field_t* table, std::string_view field,
                                             const char* group) {
  if (table == nullptr) return std::nullopt;
  for (const ucs_config_field_t* f = table; f->name != nullptr; ++f) {
    if (f->parser.read == ucs_config_sscanf_table) {
      const auto* sub = static_cast<const ucs_config_field_t*>(f->parser.arg);
      if (auto name = legacy_field_name(sub, field, group != nullptr ? group : f->name)) return name;
    } else if (field == f->name) {
      return std::string(group != nullptr ? group : "") + f->name;
    }
  }
  return std::nullopt;
}

bool ucx_before_1_17() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  return major < 1 || (major == 1 && minor < 17);
}

// Whether `text`, UCX's comma-separated list of unused "NAME=VALUE" items, holds `item`.
bool lists_item(std::string_view text, const std::string& item) {
  for (size_t at = text.find(item); at != std::string_view::npos; at = text.find(item, at + 1)) {
    const bool starts = at == 0 || text[at - 1] == ',' || text[at - 1] == ' ';
    const size_t end = at + item.size();
    if (starts && (end == text.size() || text[end] == ',' || text[end] == '\n')) return true;
  }
  return false;
}

}  // namespace

std::string ucx_setting_name(const std::string& name) {
  static const bool legacy = ucx_before_1_17();
  if (!legacy) return name;
  // The transports' tables register as their modules load: load them all, as ucp_init does.
  uct_component_h* components = nullptr;
  unsigned count = 0;
  if (uct_query_components(&components, &count) == UCS_OK) uct_release_component_list(components);
  // The longest table prefix ("TCP_", "RC_MLX5_") that starts `name` and whose table has the rest.
  std::optional<std::string> legacy_name;
  size_t prefix_length = 0;
  ucs_config_global_list_entry_t* entry;
  ucs_list_for_each(entry, &ucs_config_global_list, list) {
    const std::string_view prefix = entry->prefix != nullptr ? entry->prefix : "";
    if (prefix.empty() || prefix.size() <= prefix_length || !name.starts_with(prefix)) continue;
    if (auto found = legacy_field_name(entry->table, std::string_view(name).substr(prefix.size()), nullptr)) {
      legacy_name = std::move(found);
      prefix_length = prefix.size();
    }
  }
  return legacy_name.value_or(name);
}

// Installed once for the process; acts only on threads that are capturing.
ucs_log_func_rc_t UnusedUcxSettings::on_log(const char*, unsigned, const char*, ucs_log_level_t level,
                                            const ucs_log_component_config_t*, const char* format, va_list args) {
  if (capturing == nullptr || level != UCS_LOG_LEVEL_WARN ||
      !std::string_view(format).starts_with("invalid configuration")) {
    return UCS_LOG_FUNC_RC_CONTINUE;
  }
  va_list copy;
  va_copy(copy, args);
  char text[1024];
  std::vsnprintf(text, sizeof(text), format, copy);
  va_end(copy);
  capturing->warnings_ += text;
  return UCS_LOG_FUNC_RC_STOP;
}

UnusedUcxSettings::UnusedUcxSettings(const UcxOptions& options) : options_(options) {
  static std::once_flag installed;
  std::call_once(installed, [] { ucs_log_push_handler(on_log); });
  capturing = this;
}

UnusedUcxSettings::~UnusedUcxSettings() { capturing = nullptr; }

void UnusedUcxSettings::check() const {
  for (const UcxSetting& setting : options_.settings) {
    if (setting.param == "engine_config" && lists_item(warnings_, setting.ucx_name + "=" + setting.value)) {
      fail(ErrorKind::kConfig,
           "{}: no UCX component takes '{}={}': unknown name, a transport not in use, or a bad value (name "
           "settings as UCX's environment does, without UCX_, e.g. TCP_SNDBUF for UCX_TCP_SNDBUF; see `ucx_info "
           "-c -f`)",
           ucx_param_name(setting.param), setting.name, setting.value);
    }
  }
}

std::string ucx_param_name(const std::string& key) { return "refit_cfg.nixl.backend_init_params." + key; }

UcxOptions parse_ucx_options(const std::map<std::string, std::string>& params, bool gpu_buffers) {
  UcxOptions options;
  std::vector<UcxSetting> user;
  for (const auto& [key, value] : params) {
    if (key == "ucx_error_handling_mode") {
      if (value == "peer") {
        options.error_mode = UCP_ERR_HANDLING_MODE_PEER;
      } else if (value == "none") {
        options.error_mode = UCP_ERR_HANDLING_MODE_NONE;
      } else {
        fail(ErrorKind::kConfig, "{}='{}': expected 'peer' or 'none'", ucx_param_name(key), value);
      }
    } else if (key == "device_list" || key == "tls") {
      if (trim(value).empty())
        fail(ErrorKind::kConfig, "{}='{}': expected a comma-separated list", ucx_param_name(key), value);
      user.push_back({key == "tls" ? "TLS" : "NET_DEVICES", std::string(trim(value)), key});
    } else if (key == "engine_config") {
      parse_engine_config(value, user);
    } else {
      fail(ErrorKind::kConfig, "{}='{}': unknown UCX backend parameter (expected one of {})", ucx_param_name(key),
           value, fmt::join(config_key_names(ConfigScope::kBackendParam, "UCX"), ", "));
    }
  }
  if (options.error_mode == UCP_ERR_HANDLING_MODE_PEER) {
    // UCX's default (20 s) leaves a survivor waiting far too long for a peer that died.
    if (!user_sets(user, "KEEPALIVE_INTERVAL")) options.settings.push_back({"KEEPALIVE_INTERVAL", "1s", ""});
    // Shared memory (posix, sysv) does not claim peer error handling unless told to, which in
    // peer mode leaves only tcp on one host: 256 MiB reads then run at ~1.2 GB/s instead of 10+ GB/s.
    // Keepalive detects a dead peer on shared memory too (it checks that the process exists).
    if (!user_sets(user, "MM_ERROR_HANDLING") && !user_sets(user, "SYSV_ERROR_HANDLING") &&
        !user_sets(user, "POSIX_ERROR_HANDLING")) {
      options.settings.push_back({"MM_ERROR_HANDLING", "y", ""});
    }
  }
  // UCX 1.19 and later serve reads of GPU memory with cuda_ipc (one copy on the GPU) only where
  // NVLink joins the GPUs; otherwise, two processes on one GPU included, a read falls back to
  // software emulation through host shared memory: 0.66-0.87 GB/s on one H200 (ucx_perftest
  // ucp_get, UCX 1.22), against hundreds with cuda_ipc. Reads are how a destination takes a GPU
  // source's buckets when it does not map them, so refit turns cuda_ipc's reads on unless the
  // user decided (docs/GPU.md, "No cliff").
  if (gpu_buffers && !user_sets(user, "CUDA_IPC_ENABLE_GET_ZCOPY") &&
      std::getenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY") == nullptr)
    options.settings.push_back({"CUDA_IPC_ENABLE_GET_ZCOPY", "y", "", {}, true});
  options.settings.insert(options.settings.end(), user.begin(), user.end());
  for (UcxSetting& setting : options.settings) setting.ucx_name = ucx_setting_name(setting.name);
  return options;
}

UcpConfig make_ucp_config(const UcxOptions& options) {
  ucp_config_t* raw = nullptr;
  ucs_status_t status = ucp_config_read(nullptr, nullptr, &raw);
  if (status != UCS_OK)
    fail(ErrorKind::kConfig, "cannot read the UCX configuration from the environment: {}", ucs_status_string(status));
  UcpConfig config(raw);
  for (const UcxSetting& setting : options.settings) {
    status = ucp_config_modify(config.get(), setting.ucx_name.c_str(), setting.value.c_str());
    if (status != UCS_OK && setting.optional) continue;
    if (status != UCS_OK) {
      // UCX 1.21 and later also reject a name that no component defines this way.
      fail(ErrorKind::kConfig, "{}: UCX rejects {}={}: {}{}",
           setting.param.empty() ? std::string("refit's UCX defaults") : ucx_param_name(setting.param), setting.name,
           setting.value, ucs_status_string(status),
           setting.param == "engine_config"
               ? " (an unknown name or a bad value; name settings as UCX's environment does, without UCX_, e.g. "
                 "TCP_SNDBUF for UCX_TCP_SNDBUF; see `ucx_info -c -f`)"
               : "");
    }
  }
  return config;
}

}  // namespace refit
