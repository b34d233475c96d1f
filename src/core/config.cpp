#include "refit/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/fail.h"

namespace refit {
namespace {

constexpr std::array<std::string_view, 12> kNixlKeys = {"update_weights_bucket_memory_ratio",
                                                        "device",
                                                        "backend_name",
                                                        "backend_init_params",
                                                        "release_after_refit",
                                                        "shard_expert_weights",
                                                        "bucket_bytes",
                                                        "timeout_s",
                                                        "verify_checksums",
                                                        "map_source_buffers",
                                                        "direct_reads",
                                                        "delta"};

bool is_nixl_key(std::string_view key) { return std::find(kNixlKeys.begin(), kNixlKeys.end(), key) != kNixlKeys.end(); }

// A value as the user wrote it, for error messages.
std::string describe(const YAML::Node& node) {
  if (!node.IsDefined() || node.IsNull()) return "null";
  if (node.IsScalar()) return fmt::format("'{}'", node.Scalar());
  return node.IsSequence() ? "a list" : "a mapping";
}

// Quoted and explicitly tagged scalars are strings; only plain scalars may be numbers or bools.
bool is_plain(const YAML::Node& node) { return node.IsScalar() && node.Tag() == "?"; }

// The refit keys of one document plus the overrides, gathered before any value is checked, so
// that an override can replace a bad value from the file.
struct Raw {
  std::string prefix;  // "" or "policy.generation.", for key names in messages
  std::optional<YAML::Node> transport;
  std::map<std::string, YAML::Node> nixl;
  std::optional<std::pair<std::string, YAML::Node>> plugin;  // refit_cfg["module:ClassName"]
};

bool is_plugin_path(std::string_view s) { return s.find(':') != std::string_view::npos; }

// Rebinds the entry; yaml-cpp's Node::operator= would instead write through into the old node.
void put(std::map<std::string, YAML::Node>& map, const std::string& key, const YAML::Node& value) {
  map.erase(key);
  map.emplace(key, value);
}

// A mapping's entries, rejecting duplicate and non-scalar keys (yaml-cpp keeps duplicates silently).
std::vector<std::pair<std::string, YAML::Node>> entries(const YAML::Node& map, std::string_view path) {
  std::vector<std::pair<std::string, YAML::Node>> out;
  std::set<std::string> seen;
  for (auto it = map.begin(); it != map.end(); ++it) {
    if (!it->first.IsScalar()) fail(ErrorKind::kConfig, "{} has a key that is not a string", path);
    std::string key = it->first.Scalar();
    if (!seen.insert(key).second)
      fail(ErrorKind::kConfig, "duplicate key {}{}", path.empty() ? "" : fmt::format("{}.", path), key);
    out.emplace_back(std::move(key), it->second);
  }
  return out;
}

void gather_refit_cfg(Raw& raw, const YAML::Node& refit_cfg) {
  const std::string path = raw.prefix + "refit_cfg";
  if (!refit_cfg.IsDefined() || refit_cfg.IsNull()) return;
  if (!refit_cfg.IsMap()) fail(ErrorKind::kConfig, "{} must be a mapping, got {}", path, describe(refit_cfg));
  for (const auto& [scope, nixl] : entries(refit_cfg, path)) {
    if (is_plugin_path(scope)) {
      if (raw.plugin)
        fail(ErrorKind::kConfig, "{} has two plugin scopes, '{}' and '{}': keep the one refit_transport names", path,
             raw.plugin->first, scope);
      raw.plugin.emplace(scope, nixl);
      continue;
    }
    if (scope != "nixl") {
      fail(ErrorKind::kConfig,
           "unknown key {}.{}: refit_cfg holds the 'nixl' scope and, for a plugin transport, its 'module:ClassName' "
           "scope",
           path, scope);
    }
    if (nixl.IsNull()) continue;
    if (!nixl.IsMap()) fail(ErrorKind::kConfig, "{}.nixl must be a mapping, got {}", path, describe(nixl));
    for (const auto& [key, value] : entries(nixl, path + ".nixl")) {
      if (!is_nixl_key(key)) {
        fail(ErrorKind::kConfig, "unknown key {}.nixl.{}: valid keys are {}", path, key, fmt::join(kNixlKeys, ", "));
      }
      put(raw.nixl, key, value);
    }
  }
}

Raw gather(const YAML::Node& root, std::string_view source) {
  Raw raw;
  if (!root.IsDefined() || root.IsNull()) return raw;
  if (!root.IsMap()) fail(ErrorKind::kConfig, "{}: the config root must be a mapping, got {}", source, describe(root));
  auto root_entries = entries(root, "");
  YAML::Node scope = root;
  if (root["policy"]) {
    // A NeMo RL config: everything outside policy.generation, and NeMo's own keys inside it,
    // belong to NeMo and are ignored.
    for (const auto& [key, value] : root_entries) {
      if (key == "refit_transport" || key == "refit_cfg") {
        fail(ErrorKind::kConfig,
             "{}: '{}' is at the root of a config that also has 'policy'; put it under policy.generation", source, key);
      }
    }
    YAML::Node generation = root["policy"].IsMap() ? root["policy"]["generation"] : YAML::Node();
    if (!generation.IsDefined() || !generation.IsMap()) {
      fail(ErrorKind::kConfig, "{}: policy.generation must be a mapping holding refit_transport and refit_cfg, got {}",
           source, describe(generation));
    }
    scope.reset(generation);
    raw.prefix = "policy.generation.";
    entries(scope, "policy.generation");  // duplicate check only
  } else {
    for (const auto& [key, value] : root_entries) {
      if (key == "refit_transport" || key == "refit_cfg" || key == "checkpoint_engine") continue;
      fail(ErrorKind::kConfig,
           "{}: unknown key '{}' at the config root: expected refit_transport and refit_cfg, or a NeMo RL config "
           "with them under policy.generation",
           source, key);
    }
  }
  // V1 of the reference.
  const YAML::Node& s = scope;  // const lookups never insert keys
  if (s["checkpoint_engine"] && !s["checkpoint_engine"].IsNull()) {
    fail(ErrorKind::kConfig, "{0}checkpoint_engine was replaced by {0}refit_transport='nixl' and {0}refit_cfg.nixl.",
         raw.prefix);
  }
  if (s["refit_transport"]) raw.transport.emplace(s["refit_transport"]);
  gather_refit_cfg(raw, s["refit_cfg"]);
  return raw;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

bool strip_prefix(std::string_view& s, std::string_view prefix) {
  if (!s.starts_with(prefix)) return false;
  s.remove_prefix(prefix.size());
  return true;
}

void apply_override(Raw& raw, const std::string& text) {
  auto eq = text.find('=');
  if (eq == std::string::npos) {
    fail(ErrorKind::kConfig, "override '{}' has no '=': expected key=value, e.g. refit_cfg.nixl.device=cpu", text);
  }
  std::string_view key = trim(std::string_view(text).substr(0, eq));
  while (strip_prefix(key, "+")) {
  }  // Hydra's "+key=" / "++key=" spellings
  YAML::Node value;
  try {
    value = YAML::Load(text.substr(eq + 1));
  } catch (const YAML::Exception& e) {
    fail(ErrorKind::kConfig, "override '{}': the value is not valid YAML: {}", text, e.msg);
  }
  strip_prefix(key, "policy.generation.");
  bool scoped = strip_prefix(key, "refit_cfg.nixl.");
  if (!scoped && key == "refit_transport") {
    raw.transport.emplace(value);
  } else if (is_nixl_key(key)) {
    put(raw.nixl, std::string(key), value);
  } else if (strip_prefix(key, "backend_init_params.") && !key.empty()) {
    auto it = raw.nixl.find("backend_init_params");
    YAML::Node params =
        it != raw.nixl.end() && it->second.IsMap() ? YAML::Clone(it->second) : YAML::Node(YAML::NodeType::Map);
    params[std::string(key)] = value;
    put(raw.nixl, "backend_init_params", params);
  } else {
    fail(ErrorKind::kConfig,
         "override '{}': unknown key; expected refit_transport, refit_cfg.nixl.<key> (or just <key>) with <key> one of "
         "{}, or backend_init_params.<param>",
         text, fmt::join(kNixlKeys, ", "));
  }
}

std::string check_transport(const YAML::Node& node, const std::string& prefix) {
  const std::string key = prefix + "refit_transport";
  if (node.IsNull()) {
    fail(ErrorKind::kConfig,
         "{} is null: in the reference that means refit without a checkpoint engine (CUDA IPC / NCCL), which refit "
         "does not implement; set {}: nixl",
         key, key);
  }
  if (!node.IsScalar()) fail(ErrorKind::kConfig, "{} must be a string, got {}", key, describe(node));
  const std::string& t = node.Scalar();
  if (t == "nixl") return t;
  if (is_plugin_path(t)) {
    const auto colon = t.find(':');
    if (colon == 0 || colon + 1 == t.size() || t.find(':', colon + 1) != std::string::npos)
      fail(ErrorKind::kConfig, "{} '{}': a plugin transport is 'module:ClassName' with both parts non-empty", key, t);
    return t;
  }
  if (t == "nccl_reshard" || t == "vllm_s3_sparse" || t == "vllm_zmq_sparse") {
    fail(ErrorKind::kConfig,
         "{} '{}' is a transport of the reference that refit does not implement; refit implements 'nixl' and "
         "'module:ClassName' checkpoint-engine plugins",
         key, t);
  }
  fail(ErrorKind::kConfig, "Unknown refit transport '{}': expected 'nixl' or a 'module:ClassName' plugin path ({})", t,
       key);
}

// A YAML value as JSON, with the types YAML gives plain scalars (quoted scalars are strings).
nlohmann::json to_json(const YAML::Node& node) {
  if (!node.IsDefined() || node.IsNull()) return nullptr;
  if (node.IsSequence()) {
    auto out = nlohmann::json::array();
    for (const auto& item : node) out.push_back(to_json(item));
    return out;
  }
  if (node.IsMap()) {
    auto out = nlohmann::json::object();
    for (const auto& [key, value] : entries(node, "plugin parameter")) out[key] = to_json(value);
    return out;
  }
  if (is_plain(node)) {
    bool b = false;
    int64_t i = 0;
    double d = 0;
    if (YAML::convert<bool>::decode(node, b)) return b;
    if (YAML::convert<int64_t>::decode(node, i)) return i;
    if (YAML::convert<double>::decode(node, d) && std::isfinite(d)) return d;
  }
  return node.Scalar();
}

// "got '0.05'" alone would puzzle the user when the value was quoted.
std::string describe_typed(const YAML::Node& node) {
  return node.IsScalar() && !is_plain(node) ? describe(node) + " (a quoted string; write it without quotes)"
                                            : describe(node);
}

double number(const YAML::Node& node, const std::string& key) {
  double value = 0;
  if (!is_plain(node) || !YAML::convert<double>::decode(node, value)) {
    fail(ErrorKind::kConfig, "{} must be a number, got {}", key, describe_typed(node));
  }
  return value;
}

bool boolean(const YAML::Node& node, const std::string& key) {
  bool value = false;
  if (!is_plain(node) || !YAML::convert<bool>::decode(node, value)) {
    fail(ErrorKind::kConfig, "{} must be true or false, got {}", key, describe_typed(node));
  }
  return value;
}

uint64_t byte_count(const YAML::Node& node, const std::string& key) {
  if (!node.IsScalar())
    fail(ErrorKind::kConfig,
         "{} must be null or a positive byte count such as 268435456, 64KiB, 256MiB or 1GiB, got {}", key,
         describe(node));
  return parse_byte_count(node.Scalar(), key);
}

std::string string_value(const YAML::Node& node, const std::string& key) {
  if (!node.IsScalar() || node.Scalar().empty()) {
    fail(ErrorKind::kConfig, "{} must be a non-empty string, got {}", key, describe(node));
  }
  return node.Scalar();
}

// The plugin scope: the two keys it shares with nixl fill `config`, the others are the plugin's.
void build_plugin(const Raw& raw, RefitConfig& config) {
  const std::string path = raw.prefix + "refit_cfg";
  if (!config.uses_plugin()) {
    if (raw.plugin)
      fail(ErrorKind::kConfig, "{} has the plugin scope '{}' but {}refit_transport is '{}'", path, raw.plugin->first,
           raw.prefix, config.refit_transport);
    return;
  }
  if (!raw.plugin)
    fail(ErrorKind::kConfig, "{}refit_transport '{}' needs its scope {}['{}'] (a mapping, may be empty)", raw.prefix,
         config.refit_transport, path, config.refit_transport);
  if (raw.plugin->first != config.refit_transport)
    fail(ErrorKind::kConfig, "{} has the plugin scope '{}' but {}refit_transport is '{}'", path, raw.plugin->first,
         raw.prefix, config.refit_transport);
  const std::string scope = fmt::format("{}['{}']", path, raw.plugin->first);
  const YAML::Node& node = raw.plugin->second;
  config.update_weights_bucket_memory_ratio = RefitConfig{}.update_weights_bucket_memory_ratio;
  config.release_after_refit = false;
  if (node.IsNull()) return;
  if (!node.IsMap()) fail(ErrorKind::kConfig, "{} must be a mapping, got {}", scope, describe(node));
  for (const auto& [name, value] : entries(node, scope)) {
    const std::string key = scope + "." + name;
    if (name == "update_weights_bucket_memory_ratio") {
      const double r = number(value, key);
      if (!(r > 0 && r < 1)) fail(ErrorKind::kConfig, "{} must be > 0 and < 1, got {}", key, describe(value));
      config.update_weights_bucket_memory_ratio = r;
    } else if (name == "release_after_refit") {
      config.release_after_refit = boolean(value, key);
    } else {
      config.plugin_params[name] = to_json(value).dump();
    }
  }
}

RefitConfig build(const Raw& raw) {
  RefitConfig config;
  if (raw.transport) config.refit_transport = check_transport(*raw.transport, raw.prefix);
  for (const auto& [name, node] : raw.nixl) {
    const std::string key = raw.prefix + "refit_cfg.nixl." + name;
    if (name == "update_weights_bucket_memory_ratio") {
      double r = number(node, key);
      if (!(r > 0 && 2 * r < 1)) {  // also rejects NaN and inf
        fail(ErrorKind::kConfig,
             "{} must be > 0 and < 0.5 (each of the two transfer buffers takes this fraction of the smallest worker "
             "memory), got {}",
             key, describe(node));
      }
      config.update_weights_bucket_memory_ratio = r;
    } else if (name == "device") {
      config.device = parse_device(string_value(node, key), key);
    } else if (name == "backend_name") {
      config.backend_name = string_value(node, key);
    } else if (name == "backend_init_params") {
      config.backend_init_params.clear();
      if (node.IsNull()) continue;
      if (!node.IsMap()) fail(ErrorKind::kConfig, "{} must be null or a mapping, got {}", key, describe(node));
      for (const auto& [param, value] : entries(node, key)) {
        if (!value.IsScalar()) {
          fail(ErrorKind::kConfig, "{}.{} must be a string, number or bool, got {}", key, param, describe(value));
        }
        config.backend_init_params[param] = value.Scalar();  // as written: 8 -> "8", true -> "true"
      }
    } else if (name == "release_after_refit") {
      config.release_after_refit = boolean(node, key);
    } else if (name == "shard_expert_weights") {
      config.shard_expert_weights = boolean(node, key);
    } else if (name == "verify_checksums") {
      config.verify_checksums = boolean(node, key);
    } else if (name == "map_source_buffers") {
      config.map_source_buffers = boolean(node, key);
    } else if (name == "direct_reads") {
      config.direct_reads = boolean(node, key);
    } else if (name == "delta") {
      config.delta = boolean(node, key);
    } else if (name == "bucket_bytes") {
      config.bucket_bytes = node.IsNull() ? std::nullopt : std::optional(byte_count(node, key));
    } else if (name == "timeout_s") {
      double t = number(node, key);
      if (!(t > 0 && std::isfinite(t))) {
        fail(ErrorKind::kConfig, "{} must be a positive finite number of seconds, got {}", key, describe(node));
      }
      config.timeout_s = t;
    }
  }
  build_plugin(raw, config);
  return config;
}

RefitConfig parse(std::string_view text, std::string_view source, std::span<const std::string> overrides) {
  YAML::Node root;
  try {
    root = YAML::Load(std::string(text));
  } catch (const YAML::ParserException& e) {
    fail(ErrorKind::kConfig, "invalid YAML in {} at line {}, column {}: {}", source, e.mark.line + 1, e.mark.column + 1,
         e.msg);
  }
  Raw raw = gather(root, source);
  for (const auto& o : overrides) apply_override(raw, o);
  return build(raw);
}

}  // namespace

uint64_t parse_byte_count(std::string_view text, std::string_view key) {
  auto bad = [&]() {
    fail(ErrorKind::kConfig, "{} must be a positive byte count such as 268435456, 64KiB, 256MiB or 1GiB, got '{}'", key,
         text);
  };
  std::string_view digits = trim(text);
  uint64_t count = 0;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), count);
  if (ec != std::errc() || end == digits.data()) bad();
  std::string_view suffix = trim(std::string_view(end, digits.data() + digits.size() - end));
  constexpr std::array<std::pair<std::string_view, int>, 6> kSuffixes = {
      {{"", 0}, {"B", 0}, {"KiB", 10}, {"MiB", 20}, {"GiB", 30}, {"TiB", 40}}};
  auto it = std::find_if(kSuffixes.begin(), kSuffixes.end(), [&](auto& s) { return s.first == suffix; });
  if (it == kSuffixes.end() || count == 0 || count > (UINT64_MAX >> it->second)) bad();
  return count << it->second;
}

RefitConfig parse_config(std::string_view yaml_text, std::span<const std::string> overrides) {
  return parse(yaml_text, "<config text>", overrides);
}

RefitConfig load_config(const std::string& yaml_path, std::span<const std::string> overrides) {
  if (yaml_path.empty()) return parse("", "<defaults>", overrides);
  std::error_code ec;
  if (!std::filesystem::is_regular_file(yaml_path, ec)) {
    fail(ErrorKind::kConfig, "config file '{}' does not exist or is not a regular file", yaml_path);
  }
  std::ifstream in(yaml_path);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) fail(ErrorKind::kConfig, "cannot read config file '{}'", yaml_path);
  return parse(text.str(), yaml_path, overrides);
}

namespace {

// Writes a plugin parameter back with its type: strings quoted, so that they stay strings.
void emit_json(YAML::Emitter& out, const nlohmann::json& value) {
  if (value.is_null()) {
    out << YAML::Null;
  } else if (value.is_string()) {
    out << YAML::DoubleQuoted << value.get<std::string>();
  } else if (value.is_array()) {
    out << YAML::Flow << YAML::BeginSeq;
    for (const auto& item : value) emit_json(out, item);
    out << YAML::EndSeq;
  } else if (value.is_object()) {
    out << YAML::Flow << YAML::BeginMap;
    for (const auto& [k, v] : value.items()) {
      out << YAML::Key << YAML::DoubleQuoted << k << YAML::Value;
      emit_json(out, v);
    }
    out << YAML::EndMap;
  } else {
    out << value.dump();  // a number or bool: its JSON text is plain YAML of the same type
  }
}

}  // namespace

std::string to_yaml(const RefitConfig& config) {
  YAML::Emitter out;
  out.SetNullFormat(YAML::LowerNull);
  out << YAML::BeginMap;
  out << YAML::Key << "refit_transport" << YAML::Value << config.refit_transport;
  out << YAML::Key << "refit_cfg" << YAML::Value << YAML::BeginMap << YAML::Key << "nixl" << YAML::Value
      << YAML::BeginMap;
  // Numbers as fmt's shortest round-trip text, so parsing gives back the same double. A plugin's
  // ratio and release_after_refit are in its own scope.
  if (!config.uses_plugin())
    out << YAML::Key << "update_weights_bucket_memory_ratio" << YAML::Value
        << fmt::format("{}", config.update_weights_bucket_memory_ratio);
  out << YAML::Key << "device" << YAML::Value << to_string(config.device);
  out << YAML::Key << "backend_name" << YAML::Value << YAML::DoubleQuoted << config.backend_name;
  out << YAML::Key << "backend_init_params" << YAML::Value;
  if (config.backend_init_params.empty()) {
    out << YAML::Null;
  } else {
    out << YAML::BeginMap;
    for (const auto& [k, v] : config.backend_init_params) {
      out << YAML::Key << YAML::DoubleQuoted << k << YAML::Value << YAML::DoubleQuoted << v;
    }
    out << YAML::EndMap;
  }
  if (!config.uses_plugin()) out << YAML::Key << "release_after_refit" << YAML::Value << config.release_after_refit;
  out << YAML::Key << "shard_expert_weights" << YAML::Value << config.shard_expert_weights;
  out << YAML::Key << "bucket_bytes" << YAML::Value;
  if (config.bucket_bytes) {
    out << std::to_string(*config.bucket_bytes);
  } else {
    out << YAML::Null;
  }
  out << YAML::Key << "timeout_s" << YAML::Value << fmt::format("{}", config.timeout_s);
  out << YAML::Key << "verify_checksums" << YAML::Value << config.verify_checksums;
  out << YAML::Key << "map_source_buffers" << YAML::Value << config.map_source_buffers;
  out << YAML::Key << "direct_reads" << YAML::Value << config.direct_reads;
  out << YAML::Key << "delta" << YAML::Value << config.delta;
  out << YAML::EndMap;
  if (config.uses_plugin()) {
    out << YAML::Key << YAML::DoubleQuoted << config.refit_transport << YAML::Value << YAML::BeginMap;
    out << YAML::Key << "update_weights_bucket_memory_ratio" << YAML::Value
        << fmt::format("{}", config.update_weights_bucket_memory_ratio);
    out << YAML::Key << "release_after_refit" << YAML::Value << config.release_after_refit;
    for (const auto& [k, v] : config.plugin_params) {
      out << YAML::Key << YAML::DoubleQuoted << k << YAML::Value;
      emit_json(out, nlohmann::json::parse(v));
    }
    out << YAML::EndMap;
  }
  out << YAML::EndMap << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

}  // namespace refit
