#include "transport/ucx/ucx_options.h"

#include <ucs/config/parser.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string_view>

#include "core/fail.h"

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

// Every configuration name the loaded UCX components define, as UCX prints them.
std::set<std::string> known_ucx_names() {
  char* text = nullptr;
  size_t size = 0;
  FILE* stream = open_memstream(&text, &size);
  if (stream == nullptr) fail(ErrorKind::kTransport, "cannot list UCX configuration names: open_memstream failed");
  ucs_config_parser_print_all_opts(stream, "UCX_",
                                   static_cast<ucs_config_print_flags_t>(UCS_CONFIG_PRINT_CONFIG | UCS_CONFIG_PRINT_HIDDEN),
                                   &ucs_config_global_list);
  std::fclose(stream);
  std::set<std::string> names;
  std::string_view rest(text, size);
  while (!rest.empty()) {
    size_t end = rest.find('\n');
    std::string_view line = rest.substr(0, end);
    rest = end == std::string_view::npos ? std::string_view{} : rest.substr(end + 1);
    if (!line.starts_with("UCX_")) continue;
    line.remove_prefix(4);
    names.emplace(line.substr(0, line.find_first_of("= ")));
  }
  std::free(text);
  return names;
}

}  // namespace

std::string ucx_param_name(const std::string& key) { return "refit_cfg.nixl.backend_init_params." + key; }

UcxOptions parse_ucx_options(const std::map<std::string, std::string>& params) {
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
      if (trim(value).empty()) fail(ErrorKind::kConfig, "{}='{}': expected a comma-separated list", ucx_param_name(key), value);
      user.push_back({key == "tls" ? "TLS" : "NET_DEVICES", std::string(trim(value)), key});
    } else if (key == "engine_config") {
      parse_engine_config(value, user);
    } else {
      fail(ErrorKind::kConfig,
           "{}='{}': unknown UCX backend parameter (expected ucx_error_handling_mode, device_list, tls or "
           "engine_config)",
           ucx_param_name(key), value);
    }
  }
  if (options.error_mode == UCP_ERR_HANDLING_MODE_PEER && !user_sets(user, "KEEPALIVE_INTERVAL")) {
    // UCX's default (20 s) leaves a survivor waiting far too long for a peer that died.
    options.settings.push_back({"KEEPALIVE_INTERVAL", "1s", ""});
  }
  options.settings.insert(options.settings.end(), user.begin(), user.end());
  return options;
}

UcpConfig make_ucp_config(const UcxOptions& options) {
  ucp_config_t* raw = nullptr;
  ucs_status_t status = ucp_config_read(nullptr, nullptr, &raw);
  if (status != UCS_OK) fail(ErrorKind::kConfig, "cannot read the UCX configuration from the environment: {}", ucs_status_string(status));
  UcpConfig config(raw);
  for (const UcxSetting& setting : options.settings) {
    status = ucp_config_modify(config.get(), setting.name.c_str(), setting.value.c_str());
    if (status != UCS_OK) {
      fail(ErrorKind::kConfig, "{}: UCX rejects {}={}: {}",
           setting.param.empty() ? std::string("refit's UCX defaults") : ucx_param_name(setting.param), setting.name,
           setting.value, ucs_status_string(status));
    }
  }
  return config;
}

void check_ucx_settings_known(const UcxOptions& options) {
  std::set<std::string> known;
  for (const UcxSetting& setting : options.settings) {
    if (setting.param != "engine_config") continue;
    if (known.empty()) known = known_ucx_names();
    if (!known.contains(setting.name)) {
      fail(ErrorKind::kConfig, "{}: '{}={}' is not a UCX setting (see `ucx_info -c`; write names without UCX_)",
           ucx_param_name(setting.param), setting.name, setting.value);
    }
  }
}

}  // namespace refit
