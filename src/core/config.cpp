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

#include "core/config_rows.h"
#include "core/fail.h"
#include "core/host_threads.h"

namespace refit {

std::string_view to_string(DeltaMode mode) {
  switch (mode) {
    case DeltaMode::kOn:
      return "true";
    case DeltaMode::kAuto:
      return "auto";
    default:
      return "false";
  }
}
namespace {

// The nixl scope's keys (kNixlFields, below the value readers they use).
struct NixlField;
const NixlField* find_field(std::string_view name);
std::string field_names();

// A value as the user wrote it, for error messages.
std::string describe(const YAML::Node& node) {
  if (!node.IsDefined() || node.IsNull()) return "null";
  if (node.IsScalar()) return fmt::format("'{}'", node.Scalar());
  return node.IsSequence() ? "a list" : "a mapping";
}

// Quoted and explicitly tagged scalars are strings; only plain scalars may be numbers or bools.
bool is_plain(const YAML::Node& node) { return node.IsScalar() && node.Tag() == "?"; }

// A value and, when it comes from a config file, where: "f.yaml, line 3: ", put before the errors
// about it ("" for config text, whose lines the user may never have seen, and for overrides).
struct Value {
  YAML::Node node;
  std::string at;
};

// The refit keys of one document plus the overrides, gathered before any value is checked, so
// that an override can replace a bad value from the file.
struct Raw {
  std::string file;    // the config file's path; "" for config text
  std::string prefix;  // "" or "policy.generation.", for key names in messages
  std::optional<Value> transport;
  std::map<std::string, Value> nixl;
  std::optional<std::pair<std::string, YAML::Node>> plugin;  // refit_cfg["module:ClassName"]

  std::string at(const YAML::Mark& mark) const {
    return file.empty() || mark.is_null() ? "" : fmt::format("{}, line {}: ", file, mark.line + 1);
  }
};

// Runs `read`; an error it throws gets the value's place in the config file in front.
template <typename F>
void located(const std::string& at, F&& read) {
  if (at.empty()) return read();
  try {
    read();
  } catch (const Error& e) {
    throw Error(e.kind(), at + e.what());
  }
}

bool is_plugin_path(std::string_view s) { return s.find(':') != std::string_view::npos; }

// Rebinds the entry; yaml-cpp's Node::operator= would instead write through into the old node.
void put(std::map<std::string, Value>& map, const std::string& key, Value value) {
  map.erase(key);
  map.emplace(key, std::move(value));
}

struct Entry {
  std::string key;
  YAML::Node value;
  YAML::Mark mark;  // the key's: a null or block value's own mark is on a later line
};

// A mapping's entries, rejecting duplicate and non-scalar keys (yaml-cpp keeps duplicates silently).
std::vector<Entry> entries(const YAML::Node& map, std::string_view path) {
  std::vector<Entry> out;
  std::set<std::string> seen;
  for (auto it = map.begin(); it != map.end(); ++it) {
    if (!it->first.IsScalar()) fail(ErrorKind::kConfig, "{} has a key that is not a string", path);
    std::string key = it->first.Scalar();
    if (!seen.insert(key).second)
      fail(ErrorKind::kConfig, "duplicate key {}{}", path.empty() ? "" : fmt::format("{}.", path), key);
    out.push_back({std::move(key), it->second, it->first.Mark()});
  }
  return out;
}

void gather_refit_cfg(Raw& raw, const YAML::Node& refit_cfg) {
  const std::string path = raw.prefix + "refit_cfg";
  if (!refit_cfg.IsDefined() || refit_cfg.IsNull()) return;
  if (!refit_cfg.IsMap())
    fail(ErrorKind::kConfig, "{}{} must be a mapping, got {}", raw.at(refit_cfg.Mark()), path, describe(refit_cfg));
  for (const auto& [scope, nixl, mark] : entries(refit_cfg, path)) {
    if (is_plugin_path(scope)) {
      if (raw.plugin)
        fail(ErrorKind::kConfig, "{} has two plugin scopes, '{}' and '{}': keep the one refit_transport names", path,
             raw.plugin->first, scope);
      raw.plugin.emplace(scope, nixl);
      continue;
    }
    if (scope != "nixl") {
      fail(ErrorKind::kConfig,
           "{}unknown key {}.{}: refit_cfg holds the 'nixl' scope and, for a plugin transport, its "
           "'module:ClassName' scope",
           raw.at(mark), path, scope);
    }
    if (nixl.IsNull()) continue;
    if (!nixl.IsMap())
      fail(ErrorKind::kConfig, "{}{}.nixl must be a mapping, got {}", raw.at(mark), path, describe(nixl));
    for (const auto& [key, value, key_mark] : entries(nixl, path + ".nixl")) {
      if (!find_field(key))
        fail(ErrorKind::kConfig, "{}unknown key {}.nixl.{}: valid keys are {}", raw.at(key_mark), path, key,
             field_names());
      put(raw.nixl, key, {value, raw.at(key_mark)});
    }
  }
}

// `file`: the config file's path, "" for config text.
Raw gather(const YAML::Node& root, std::string_view file) {
  Raw raw;
  raw.file = file;
  // Before an error about a root key: the file and line, or that it is in the text.
  auto where = [&](const YAML::Mark& mark) { return file.empty() ? "<config text>: " : raw.at(mark); };
  if (!root.IsDefined() || root.IsNull()) return raw;
  if (!root.IsMap())
    fail(ErrorKind::kConfig, "{}the config root must be a mapping, got {}", where(root.Mark()), describe(root));
  auto scope_entries = entries(root, "");
  YAML::Node scope = root;
  if (root["policy"]) {
    // A NeMo RL config: everything outside policy.generation, and NeMo's own keys inside it,
    // belong to NeMo and are ignored.
    YAML::Mark policy;
    for (const auto& [key, value, mark] : scope_entries) {
      if (key == "refit_transport" || key == "refit_cfg") {
        fail(ErrorKind::kConfig,
             "{}'{}' is at the root of a config that also has 'policy'; put it under policy.generation", where(mark),
             key);
      }
      if (key == "policy") policy = mark;
    }
    YAML::Node generation = root["policy"].IsMap() ? root["policy"]["generation"] : YAML::Node();
    if (!generation.IsDefined() || !generation.IsMap()) {
      fail(ErrorKind::kConfig, "{}policy.generation must be a mapping holding refit_transport and refit_cfg, got {}",
           where(policy), describe(generation));
    }
    scope.reset(generation);
    raw.prefix = "policy.generation.";
    scope_entries = entries(scope, "policy.generation");
  } else {
    for (const auto& [key, value, mark] : scope_entries) {
      if (key == "refit_transport" || key == "refit_cfg" || key == "checkpoint_engine") continue;
      fail(ErrorKind::kConfig,
           "{}unknown key '{}' at the config root: expected refit_transport and refit_cfg, or a NeMo RL config "
           "with them under policy.generation",
           where(mark), key);
    }
  }
  // V1 of the reference.
  const YAML::Node& s = scope;  // const lookups never insert keys
  if (s["checkpoint_engine"] && !s["checkpoint_engine"].IsNull()) {
    fail(ErrorKind::kConfig, "{0}checkpoint_engine was replaced by {0}refit_transport='nixl' and {0}refit_cfg.nixl.",
         raw.prefix);
  }
  for (const auto& [key, value, mark] : scope_entries)
    if (key == "refit_transport") raw.transport.emplace(Value{value, raw.at(mark)});
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
    raw.transport.emplace(Value{value, ""});
  } else if (find_field(key)) {
    put(raw.nixl, std::string(key), {value, ""});
  } else if (strip_prefix(key, "backend_init_params.") && !key.empty()) {
    auto it = raw.nixl.find("backend_init_params");
    YAML::Node params = it != raw.nixl.end() && it->second.node.IsMap() ? YAML::Clone(it->second.node)
                                                                        : YAML::Node(YAML::NodeType::Map);
    params[std::string(key)] = value;
    put(raw.nixl, "backend_init_params", {params, ""});
  } else {
    fail(ErrorKind::kConfig,
         "override '{}': unknown key; expected refit_transport, refit_cfg.nixl.<key> (or just <key>) with <key> one of "
         "{}, or backend_init_params.<param>",
         text, field_names());
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
    for (const auto& [key, value, mark] : entries(node, "plugin parameter")) out[key] = to_json(value);
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

DeltaMode delta_mode(const YAML::Node& node, const std::string& key) {
  // Quoted or not ("auto" from JSON or Python is a string): it cannot be mistaken for a bool.
  if (node.IsScalar() && node.Scalar() == "auto") return DeltaMode::kAuto;
  bool value = false;
  if (!is_plain(node) || !YAML::convert<bool>::decode(node, value))
    fail(ErrorKind::kConfig, "{} must be true, false or auto, got {}", key, describe_typed(node));
  return value ? DeltaMode::kOn : DeltaMode::kOff;
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

// Writes a YAML scalar as its own text (numbers as fmt's shortest round-trip text, so parsing gives
// back the same double).
template <typename T>
void emit_plain(YAML::Emitter& out, const T& value) {
  out << fmt::format("{}", value);
}

// One key of the nixl scope: its row of the configuration table (config_keys.h), how the parser
// reads it into a RefitConfig (after the file and every override are gathered) and how to_yaml
// writes it. The defaults are RefitConfig's member initializers, written by `write`.
struct NixlField {
  std::string_view name;
  std::string_view type;
  bool extension;
  std::string_view summary;
  bool plugin_scope;  // a plugin transport's scope holds it instead of nixl's
  void (*read)(RefitConfig& config, const YAML::Node& node, const std::string& key);
  void (*write)(YAML::Emitter& out, const RefitConfig& config);
};

const NixlField kNixlFields[] = {
    {"update_weights_bucket_memory_ratio", "number", false,
     "fraction of the smallest worker's memory each of the two transfer buffers takes; 0 < r < 0.5", true,
     [](RefitConfig& c, const YAML::Node& node, const std::string& key) {
       const double r = number(node, key);
       if (!(r > 0 && 2 * r < 1))  // also rejects NaN and inf
         fail(ErrorKind::kConfig,
              "{} must be > 0 and < 0.5 (each of the two transfer buffers takes this fraction of the smallest worker "
              "memory), got {}",
              key, describe(node));
       c.update_weights_bucket_memory_ratio = r;
     },
     [](YAML::Emitter& out, const RefitConfig& c) { emit_plain(out, c.update_weights_bucket_memory_ratio); }},
    {"device", "cpu | cuda | cuda:N", false, "where the transfer buffers live", false,
     [](RefitConfig& c, const YAML::Node& node, const std::string& key) {
       c.device = parse_device(string_value(node, key), key);
     },
     [](YAML::Emitter& out, const RefitConfig& c) { out << to_string(c.device); }},
    {"backend_name", "string", false, "the transport backend: UCX, CUDA_IPC, NCCL (C++) or NIXL (Python)", false,
     [](RefitConfig& c, const YAML::Node& node, const std::string& key) { c.backend_name = string_value(node, key); },
     [](YAML::Emitter& out, const RefitConfig& c) { out << YAML::DoubleQuoted << c.backend_name; }},
    {"backend_init_params", "mapping or null", false, "the backend's parameters, values as strings", false,
     [](RefitConfig& c, const YAML::Node& node, const std::string& key) {
       c.backend_init_params.clear();
       if (node.IsNull()) return;
       if (!node.IsMap()) fail(ErrorKind::kConfig, "{} must be null or a mapping, got {}", key, describe(node));
       for (const auto& [param, value, mark] : entries(node, key)) {
         if (!value.IsScalar())
           fail(ErrorKind::kConfig, "{}.{} must be a string, number or bool, got {}", key, param, describe(value));
         c.backend_init_params[param] = value.Scalar();  // as written: 8 -> "8", true -> "true"
       }
     },
     [](YAML::Emitter& out, const RefitConfig& c) {
       if (c.backend_init_params.empty()) {
         out << YAML::Null;
         return;
       }
       out << YAML::BeginMap;
       for (const auto& [k, v] : c.backend_init_params)
         out << YAML::Key << YAML::DoubleQuoted << k << YAML::Value << YAML::DoubleQuoted << v;
       out << YAML::EndMap;
     }},
    {"release_after_refit", "bool", false, "free the transfer buffers after every refit", true,
     [](RefitConfig& c, const YAML::Node& node, const std::string& key) { c.release_after_refit = boolean(node, key); },
     [](YAML::Emitter& out, const RefitConfig& c) { out << c.release_after_refit; }},
    {"shard_expert_weights", "bool", false, "send each destination only its expert shards (needs a layout)", false,
     [](RefitConfig& c, const YAML::Node& node, const std::string& key) {
       c.shard_expert_weights = boolean(node, key);
     },
     [](YAML::Emitter& out, const RefitConfig& c) { out << c.shard_expert_weights; }},
    {"bucket_bytes", "byte count or null", true, "a fixed size of each transfer buffer instead of the ratio", false,
     [](RefitConfig& c, const YAML::Node& node, const std::string& key) {
       c.bucket_bytes = node.IsNull() ? std::nullopt : std::optional(byte_count(node, key));
     },
     [](YAML::Emitter& out, const RefitConfig& c) {
       if (c.bucket_bytes)
         emit_plain(out, *c.bucket_bytes);
       else
         out << YAML::Null;
     }},
    {"timeout_s", "number", true, "the deadline, in seconds, of every wait of one refit phase", false,
     [](RefitConfig& c, const YAML::Node& node, const std::string& key) {
       const double t = number(node, key);
       if (!(t > 0 && std::isfinite(t)))
         fail(ErrorKind::kConfig, "{} must be a positive finite number of seconds, got {}", key, describe(node));
       c.timeout_s = t;
     },
     [](YAML::Emitter& out, const RefitConfig& c) { emit_plain(out, c.timeout_s); }},
    {"verify_checksums", "bool", true, "an xxh3 checksum per bucket, checked on arrival", false,
     [](RefitConfig& c, const YAML::Node& node, const std::string& key) { c.verify_checksums = boolean(node, key); },
     [](YAML::Emitter& out, const RefitConfig& c) { out << c.verify_checksums; }},
    {"map_source_buffers", "bool", true, "load from a same-host source's transfer buffers, mapped", false,
     [](RefitConfig& c, const YAML::Node& node, const std::string& key) { c.map_source_buffers = boolean(node, key); },
     [](YAML::Emitter& out, const RefitConfig& c) { out << c.map_source_buffers; }},
    {"direct_reads", "bool", true, "load a same-host source's tensors in place, no bucket", false,
     [](RefitConfig& c, const YAML::Node& node, const std::string& key) { c.direct_reads = boolean(node, key); },
     [](YAML::Emitter& out, const RefitConfig& c) { out << c.direct_reads; }},
    {"delta", "bool or auto", true, "send only the elements whose bits changed since the last refit", false,
     [](RefitConfig& c, const YAML::Node& node, const std::string& key) { c.delta = delta_mode(node, key); },
     [](YAML::Emitter& out, const RefitConfig& c) { out << std::string(to_string(c.delta)); }},
};

const NixlField* find_field(std::string_view name) {
  for (const NixlField& f : kNixlFields)
    if (f.name == name) return &f;
  return nullptr;
}

std::string field_names() {
  std::string out;
  for (const NixlField& f : kNixlFields) out += fmt::format("{}{}", out.empty() ? "" : ", ", f.name);
  return out;
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
  for (const auto& [name, value, mark] : entries(node, scope)) {
    const std::string key = scope + "." + name;
    located(raw.at(mark), [&] {
      if (name == "update_weights_bucket_memory_ratio") {
        const double r = number(value, key);
        if (!(r > 0 && r < 1)) fail(ErrorKind::kConfig, "{} must be > 0 and < 1, got {}", key, describe(value));
        config.update_weights_bucket_memory_ratio = r;
      } else if (name == "release_after_refit") {
        config.release_after_refit = boolean(value, key);
      } else {
        config.plugin_params[name] = to_json(value).dump();
      }
    });
  }
}

RefitConfig build(const Raw& raw) {
  RefitConfig config;
  if (raw.transport)
    located(raw.transport->at, [&] { config.refit_transport = check_transport(raw.transport->node, raw.prefix); });
  for (const auto& [name, value] : raw.nixl)  // gather() let known keys only
    located(value.at, [&] { find_field(name)->read(config, value.node, raw.prefix + "refit_cfg.nixl." + name); });
  build_plugin(raw, config);
  return config;
}

// `file`: the config file's path, "" for config text.
RefitConfig parse(std::string_view text, std::string_view file, std::span<const std::string> overrides) {
  YAML::Node root;
  try {
    root = YAML::Load(std::string(text));
  } catch (const YAML::ParserException& e) {
    fail(ErrorKind::kConfig, "invalid YAML in {} at line {}, column {}: {}", file.empty() ? "<config text>" : file,
         e.mark.line + 1, e.mark.column + 1, e.msg);
  }
  Raw raw = gather(root, file);
  for (const auto& o : overrides) apply_override(raw, o);
  RefitConfig config = build(raw);
  // The environment is configuration too (config_keys.h): a bad REFIT_HOST_COPY_THREADS is refused
  // here, where a program starts, rather than at the first large copy of a refit.
  host_copy_threads();
  return config;
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
  return parse(yaml_text, "", overrides);
}

RefitConfig load_config(const std::string& yaml_path, std::span<const std::string> overrides) {
  if (yaml_path.empty()) return parse("", "", overrides);
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
  for (const NixlField& f : kNixlFields) {
    if (f.plugin_scope && config.uses_plugin()) continue;  // in the plugin's scope below
    out << YAML::Key << std::string(f.name) << YAML::Value;
    f.write(out, config);
  }
  out << YAML::EndMap;
  if (config.uses_plugin()) {
    out << YAML::Key << YAML::DoubleQuoted << config.refit_transport << YAML::Value << YAML::BeginMap;
    for (const NixlField& f : kNixlFields) {
      if (!f.plugin_scope) continue;
      out << YAML::Key << std::string(f.name) << YAML::Value;
      f.write(out, config);
    }
    for (const auto& [k, v] : config.plugin_params) {
      out << YAML::Key << YAML::DoubleQuoted << k << YAML::Value;
      emit_json(out, nlohmann::json::parse(v));
    }
    out << YAML::EndMap;
  }
  out << YAML::EndMap << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::vector<ConfigKey> nixl_config_rows() {
  static const std::vector<std::string> defaults = [] {
    std::vector<std::string> out;
    for (const NixlField& f : kNixlFields) {
      YAML::Emitter value;
      value.SetNullFormat(YAML::LowerNull);
      f.write(value, RefitConfig{});
      std::string text = value.c_str();
      if (text.size() >= 2 && text.front() == '"' && text.back() == '"') text = text.substr(1, text.size() - 2);
      out.push_back(std::move(text));
    }
    return out;
  }();
  std::vector<ConfigKey> rows;
  for (size_t i = 0; i < std::size(kNixlFields); ++i) {
    const NixlField& f = kNixlFields[i];
    rows.push_back({ConfigScope::kNixl, f.name, f.type, defaults[i], {}, f.extension, f.summary});
  }
  return rows;
}

}  // namespace refit
