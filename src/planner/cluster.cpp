#include "refit/cluster.h"

#include <yaml-cpp/yaml.h>

#include <cctype>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>

#include "core/fail.h"
#include "planner/paired_model.h"
#include "refit/config.h"

namespace refit {
namespace {

// "30us" -> (30, "us"), "400 Gbit/s" -> (400, "Gbit/s"); nothing when it does not start with a
// finite number.
std::optional<std::pair<double, std::string>> split_number(const std::string& text) {
  size_t end = 0;
  double number = 0;
  try {
    number = std::stod(text, &end);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  if (!std::isfinite(number)) return std::nullopt;
  std::string unit = text.substr(end);
  while (!unit.empty() && std::isspace(static_cast<unsigned char>(unit.front()))) unit.erase(0, 1);
  return std::pair(number, unit);
}

// One YAML mapping being read: every key must be known, and errors name the key's full path.
class Section {
 public:
  Section(const YAML::Node& node, std::string path, const std::string& origin)
      : node_(node), path_(std::move(path)), origin_(origin) {
    if (node_ && !node_.IsMap()) fail(ErrorKind::kConfig, "{}: '{}' must be a mapping", origin_, path_);
  }
  std::string key(const std::string& name) const { return path_.empty() ? name : path_ + "." + name; }
  bool has(const std::string& name) const { return node_ && node_[name]; }
  YAML::Node at(const std::string& name) const { return node_ ? node_[name] : YAML::Node(); }
  Section sub(const std::string& name) const {
    used_.insert(name);
    return Section(at(name), key(name), origin_);
  }

  std::string text(const std::string& name, std::optional<std::string> fallback = std::nullopt) const {
    used_.insert(name);
    if (!has(name)) {
      if (fallback) return *fallback;
      fail(ErrorKind::kConfig, "{}: '{}' is missing", origin_, key(name));
    }
    if (!at(name).IsScalar()) fail(ErrorKind::kConfig, "{}: '{}' must be a single value", origin_, key(name));
    return at(name).Scalar();
  }
  int integer(const std::string& name, std::optional<int> fallback = std::nullopt, int minimum = 1) const {
    const std::string v = text(name, fallback ? std::optional(std::to_string(*fallback)) : std::nullopt);
    size_t end = 0;
    int n = 0;
    try {
      n = std::stoi(v, &end);
    } catch (const std::exception&) {
      end = 0;
    }
    if (end != v.size() || v.empty())
      fail(ErrorKind::kConfig, "{}: '{}' must be an integer, got '{}'", origin_, key(name), v);
    if (n < minimum) fail(ErrorKind::kConfig, "{}: '{}' must be >= {}, got {}", origin_, key(name), minimum, n);
    return n;
  }
  bool flag(const std::string& name, bool fallback) const {
    const std::string v = text(name, fallback ? "true" : "false");
    if (v == "true") return true;
    if (v == "false") return false;
    fail(ErrorKind::kConfig, "{}: '{}' must be true or false, got '{}'", origin_, key(name), v);
  }
  double rate(const std::string& name) const {
    return has(name) ? parse_rate(text(name), origin_ + ": " + key(name)) : 0;
  }
  double seconds(const std::string& name) const;
  uint64_t bytes(const std::string& name) const {
    return has(name) ? parse_byte_count(text(name), origin_ + ": " + key(name)) : 0;
  }
  // Every key of the mapping was read: a misspelt key is an error, not a silent default.
  void check_all_used() const {
    if (!node_) return;
    for (const auto& kv : node_) {
      const std::string k = kv.first.as<std::string>();
      if (!used_.count(k)) fail(ErrorKind::kConfig, "{}: unknown key '{}'", origin_, key(k));
    }
  }
  void use(const std::string& name) const { used_.insert(name); }
  const YAML::Node& node() const { return node_; }

 private:
  YAML::Node node_;
  std::string path_;
  const std::string& origin_;
  mutable std::set<std::string> used_;
};

double Section::seconds(const std::string& name) const {
  if (!has(name)) return -1;
  const std::string v = text(name);
  static const std::map<std::string, double> kUnits = {{"s", 1}, {"ms", 1e-3}, {"us", 1e-6}, {"ns", 1e-9}};
  const auto parsed = split_number(v);
  const auto it = parsed ? kUnits.find(parsed->second) : kUnits.end();
  if (it == kUnits.end() || parsed->first < 0)
    fail(ErrorKind::kConfig, "{}: '{}' must be a duration such as 30us, 2ms or 0.5s, got '{}'", origin_, key(name), v);
  return parsed->first * it->second;
}

NodeGroup read_group(const Section& s, size_t index) {
  NodeGroup g;
  g.name = s.text("name");
  g.count = s.integer("count", 1);
  g.workers = s.integer("workers");
  const std::string device = s.text("device", "gpu");
  if (device != "gpu" && device != "cpu")
    fail(ErrorKind::kConfig, "nodes[{}] ({}): 'device' must be gpu or cpu, got '{}'", index, g.name, device);
  g.gpu = device == "gpu";
  g.gpus = g.gpu ? s.integer("gpus", g.workers) : 0;
  g.cores = s.has("cores") ? s.integer("cores") : 0;
  if (s.has("nic")) {
    const Section nic = s.sub("nic");
    const std::string per = nic.text("per", g.gpu ? "worker" : "node");
    if (per != "worker" && per != "node")
      fail(ErrorKind::kConfig, "{}: must be worker or node, got '{}'", nic.key("per"), per);
    g.nic_per_worker = per == "worker";
    g.rails = nic.integer("rails", 1);
    g.rail_rate = nic.rate("rate");
    nic.check_all_used();
  } else {
    g.nic_per_worker = g.gpu;
  }
  g.nvlink_rate = s.rate("nvlink");
  g.pcie_rate = s.rate("pcie");
  g.pcie_duplex_rate = s.rate("pcie_duplex");
  g.copy_rate = s.rate("copy");
  g.node_copy_rate = s.rate("node_copy");
  g.crowded_copy_rate = s.rate("crowded_copy");
  g.memory = s.bytes("memory");
  g.row_cost_s = std::max(s.seconds("row_cost"), 0.0);
  g.copy_cost_s = s.seconds("copy_cost");
  g.in_place_copy_rate = s.rate("in_place_copy");
  g.in_place_cost_s = s.seconds("in_place_cost");
  g.in_place_crowded_rate = s.rate("in_place_crowded_copy");
  g.machine = s.text("machine", "");
  g.tcp_rate = s.rate("tcp");
  s.check_all_used();
  return g;
}

ClusterSide read_side(const Section& s, bool sources) {
  ClusterSide side;
  side.nodes = s.text("nodes");
  side.ranks = s.integer("ranks");
  if (s.has("first_slot"))
    side.first_slot = s.integer("first_slot", 0, 0);
  else
    side.first_slot = -1;  // placed after the other side when both share a group
  const Section p = s.sub("parallel");
  const std::vector<std::string> keys = sources ? std::vector<std::string>{"tp", "pp", "dp", "ep", "etp", "fsdp"}
                                                : std::vector<std::string>{"tp", "ep", "pp"};
  for (const auto& k : keys)
    if (p.has(k)) side.parallel[k] = p.integer(k);
  if (!sources) {
    side.shard_dense = p.flag("shard_dense", false);
    side.shard_experts = p.flag("shard_experts", false);
  }
  p.check_all_used();
  s.check_all_used();
  return side;
}

}  // namespace

const NodeGroup& Cluster::group(const std::string& name) const {
  for (const auto& g : groups)
    if (g.name == name) return g;
  std::string known;
  for (const auto& g : groups) known += (known.empty() ? "" : ", ") + g.name;
  fail(ErrorKind::kConfig, "cluster '{}': no node group named '{}' (groups: {})", this->name, name, known);
}

double parse_rate(const std::string& text, const std::string& key) {
  // Bits (network rates) and bytes (copy rates), decimal or binary prefixes, with or without "/s".
  static const std::map<std::string, double> kUnits = {{"Gbit", 1e9 / 8},
                                                       {"Gb", 1e9 / 8},
                                                       {"Mbit", 1e6 / 8},
                                                       {"Mb", 1e6 / 8},
                                                       {"Tbit", 1e12 / 8},
                                                       {"TB", 1e12},
                                                       {"GB", 1e9},
                                                       {"MB", 1e6},
                                                       {"KB", 1e3},
                                                       {"B", 1},
                                                       {"TiB", 1099511627776.0},
                                                       {"GiB", 1073741824.0},
                                                       {"MiB", 1048576.0},
                                                       {"KiB", 1024.0}};
  auto parsed = split_number(text);
  if (parsed && parsed->second.size() > 2 && parsed->second.ends_with("/s"))
    parsed->second.resize(parsed->second.size() - 2);
  const auto it = parsed ? kUnits.find(parsed->second) : kUnits.end();
  if (it == kUnits.end() || !(parsed->first > 0))
    fail(ErrorKind::kConfig, "{}: expected a rate such as 400Gbit, 50GB/s or 900MiB/s, got '{}'", key, text);
  return parsed->first * it->second;
}

Cluster parse_cluster(const std::string& yaml, const std::string& origin) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml);
  } catch (const YAML::Exception& e) {
    fail(ErrorKind::kConfig, "{}: not valid YAML: {}", origin, e.what());
  }
  const Section top(root, "", origin);
  Cluster c;
  c.name = top.text("name", "cluster");
  c.model = top.text("model", "");
  top.use("nodes");
  const YAML::Node nodes = top.at("nodes");
  if (!nodes || !nodes.IsSequence() || nodes.size() == 0)
    fail(ErrorKind::kConfig, "{}: 'nodes' must be a list of node groups", origin);
  for (size_t i = 0; i < nodes.size(); ++i) {
    c.groups.push_back(read_group(Section(nodes[i], fmt::format("nodes[{}]", i), origin), i));
    for (size_t j = 0; j < i; ++j)
      if (c.groups[j].name == c.groups[i].name)
        fail(ErrorKind::kConfig, "{}: two node groups are named '{}'", origin, c.groups[i].name);
  }
  c.sources = read_side(top.sub("sources"), true);
  c.destinations = read_side(top.sub("destinations"), false);
  const Section t = top.sub("transfer");
  c.transfer.bucket_bytes = t.bytes("bucket");
  c.transfer.transport = t.text("transport", "ucx");
  if (c.transfer.transport != "ucx" && c.transfer.transport != "cuda_ipc" && c.transfer.transport != "nccl")
    fail(ErrorKind::kConfig, "{}: 'transfer.transport' must be ucx, cuda_ipc or nccl, got '{}'", origin,
         c.transfer.transport);
  c.transfer.mapped = t.flag("mapped", true);
  c.transfer.direct_reads = t.flag("direct_reads", true);
  c.transfer.tcp = t.flag("tcp", false);
  const std::string buffers = t.text("buffers", "device");
  if (buffers != "device" && buffers != "host")
    fail(ErrorKind::kConfig, "{}: 'transfer.buffers' must be device or host, got '{}'", origin, buffers);
  c.transfer.host_buffers = buffers == "host";
  c.transfer.read_rate = t.rate("read_rate");
  c.transfer.latency_s = t.seconds("latency");
  c.transfer.turnaround_s = t.seconds("turnaround");
  c.transfer.in_place_turnaround_s = t.seconds("in_place_turnaround");
  c.transfer.in_place_latency_s = t.seconds("in_place_latency");
  c.transfer.in_place_ack_latency_s = t.seconds("in_place_ack_latency");
  c.transfer.ack_latency_s = t.seconds("ack_latency");
  c.transfer.overhead_s = t.seconds("overhead");
  t.check_all_used();
  top.check_all_used();

  // Place the sides: a side without first_slot in a group shared with the other side follows it.
  ClusterSide* sides[2] = {&c.sources, &c.destinations};
  for (int k = 0; k < 2; ++k) {
    ClusterSide& side = *sides[k];
    const ClusterSide& other = *sides[1 - k];
    if (side.first_slot < 0)
      side.first_slot = (k == 1 && other.nodes == side.nodes) ? std::max(other.first_slot, 0) + other.ranks : 0;
  }
  for (int k = 0; k < 2; ++k) {
    const ClusterSide& side = *sides[k];
    const NodeGroup& g = c.group(side.nodes);
    const int slots = g.count * g.workers;
    if (side.first_slot + side.ranks > slots)
      fail(ErrorKind::kConfig, "{}: the {} need slots {}..{} of node group '{}', which has {} ({} nodes x {} workers)",
           origin, k == 0 ? "sources" : "destinations", side.first_slot, side.first_slot + side.ranks - 1, g.name,
           slots, g.count, g.workers);
  }
  if (c.sources.nodes == c.destinations.nodes) {
    const int a0 = c.sources.first_slot, a1 = a0 + c.sources.ranks, b0 = c.destinations.first_slot,
              b1 = b0 + c.destinations.ranks;
    if (a0 < b1 && b0 < a1)
      fail(ErrorKind::kConfig, "{}: sources (slots {}..{}) and destinations (slots {}..{}) share worker slots of '{}'",
           origin, a0, a1 - 1, b0, b1 - 1, c.sources.nodes);
  }
  return c;
}

Cluster load_cluster(const std::string& path) {
  std::ifstream f(path);
  if (!f) fail(ErrorKind::kIo, "cannot read cluster file '{}'", path);
  std::stringstream text;
  text << f.rdbuf();
  return parse_cluster(text.str(), path);
}

namespace {

// A calibration file's numbers: the key, the field, and the value that means "not measured".
struct CalibrationField {
  const char* key;
  double Calibration::*field;
  double unset;
};
constexpr CalibrationField kCalibrationFields[] = {
    {"host_copy_bytes_per_s", &Calibration::host_copy_rate, 0},
    {"host_node_copy_bytes_per_s", &Calibration::host_node_copy_rate, 0},
    {"engine_copy_bytes_per_s", &Calibration::engine_copy_rate, 0},
    {"engine_node_copy_bytes_per_s", &Calibration::engine_node_copy_rate, 0},
    {"engine_crowded_copy_bytes_per_s", &Calibration::engine_crowded_copy_rate, 0},
    {"row_cost_s", &Calibration::row_cost_s, 0},
    {"engine_copy_cost_s", &Calibration::engine_copy_cost_s, -1},
    {"engine_in_place_copy_bytes_per_s", &Calibration::engine_in_place_copy_rate, 0},
    {"engine_in_place_copy_cost_s", &Calibration::engine_in_place_copy_cost_s, -1},
    {"in_place_turnaround_s", &Calibration::in_place_turnaround_s, -1},
    {"in_place_latency_s", &Calibration::in_place_latency_s, -1},
    {"in_place_ack_latency_s", &Calibration::in_place_ack_latency_s, -1},
    {"engine_in_place_crowded_copy_bytes_per_s", &Calibration::engine_in_place_crowded_copy_rate, 0},
    {"read_bytes_per_s", &Calibration::read_rate, 0},
    {"tcp_read_bytes_per_s", &Calibration::tcp_rate, 0},
    {"latency_s", &Calibration::latency_s, -1},
    {"ack_latency_s", &Calibration::ack_latency_s, -1},
    {"turnaround_s", &Calibration::turnaround_s, -1},
    {"overhead_s", &Calibration::overhead_s, -1},
    {"device_copy_bytes_per_s", &Calibration::device_copy_rate, 0},
    {"pinned_copy_bytes_per_s", &Calibration::pinned_copy_rate, 0},
    {"duplex_pinned_copy_bytes_per_s", &Calibration::duplex_pinned_copy_rate, 0},
    {"peer_copy_bytes_per_s", &Calibration::peer_copy_rate, 0},
    {"nccl_bytes_per_s", &Calibration::nccl_rate, 0},
    {"delta_bytes", &Calibration::delta_bytes, 0},
    {"delta_changes", &Calibration::delta_changes, 0},
    {"delta_compare_s", &Calibration::delta_compare_s, -1},
    {"delta_patch_s", &Calibration::delta_patch_s, -1},
};

}  // namespace

void load_calibration(const std::string& path, Calibration& into) {
  std::ifstream f(path);
  if (!f) fail(ErrorKind::kIo, "cannot read calibration file '{}'", path);
  nlohmann::json j;
  try {
    f >> j;
  } catch (const nlohmann::json::exception& e) {
    fail(ErrorKind::kConfig, "calibration file '{}' is not valid JSON: {}", path, e.what());
  }
  if (!j.is_object()) fail(ErrorKind::kConfig, "calibration file '{}' must hold a JSON object", path);
  auto number = [&](const char* key) -> std::optional<double> {
    if (!j.contains(key)) return std::nullopt;
    if (!j[key].is_number()) fail(ErrorKind::kConfig, "calibration file '{}': '{}' must be a number", path, key);
    return j[key].get<double>();
  };
  for (const auto& [key, field, unset] : kCalibrationFields)
    if (auto v = number(key); v && *v != unset) into.*field = *v;
  if (auto v = number("cores"); v && *v > 0) into.cores = static_cast<int>(*v);
  if (auto v = number("host_memory_bytes"); v && *v > 0) into.host_memory = static_cast<uint64_t>(*v);
  if (j.contains("machine") && j["machine"].is_string()) into.machine = j["machine"].get<std::string>();
  if (j.contains("engine_device") && j["engine_device"].is_string())
    into.engine_device = j["engine_device"].get<std::string>();
}

void save_calibration(const std::string& path, const Calibration& c) {
  nlohmann::json j = {{"machine", c.machine}};
  if (!c.engine_device.empty()) j["engine_device"] = c.engine_device;
  for (const auto& [key, field, unset] : kCalibrationFields)
    if (c.*field != unset) j[key] = c.*field;
  if (c.cores > 0) j["cores"] = c.cores;
  if (c.host_memory > 0) j["host_memory_bytes"] = c.host_memory;
  std::ofstream f(path);
  f << j.dump(2) << "\n";
  if (!f) fail(ErrorKind::kIo, "cannot write calibration file '{}'", path);
}

NodeGroup measured_node(const Calibration& cal, bool gpu) {
  const bool engine = cal.engine_device == (gpu ? "cuda" : "cpu");
  NodeGroup g;
  g.gpu = gpu;
  if (gpu) {
    g.copy_rate = engine && cal.engine_copy_rate > 0 ? cal.engine_copy_rate : cal.device_copy_rate;
    g.node_copy_rate = engine ? cal.engine_node_copy_rate : 0;
  } else {
    g.copy_rate = engine && cal.engine_copy_rate > 0 ? cal.engine_copy_rate : cal.host_copy_rate;
    g.node_copy_rate = engine && cal.engine_node_copy_rate > 0 ? cal.engine_node_copy_rate : cal.host_node_copy_rate;
    g.cores = cal.cores;
  }
  return g;
}

void apply_calibration(Cluster& cluster, const Calibration& cal) {
  auto need = [&](const NodeGroup& g, double value, const char* key) {
    if (value <= 0)
      fail(ErrorKind::kConfig,
           "cluster '{}', node group '{}': '{}' is not given and no calibration measured it (refit bench --baseline "
           "--calibration-out, or refit_gpu_ceiling --calibration-out)",
           cluster.name, g.name, key);
  };
  for (auto& g : cluster.groups) {
    // The engine's measured copy rates apply to nodes of the kind the measuring bench ran on.
    const bool engine = cal.engine_device == (g.gpu ? "cuda" : "cpu");
    if (g.copy_cost_s < 0) g.copy_cost_s = engine ? std::max(cal.engine_copy_cost_s, 0.0) : 0;
    if (g.in_place_cost_s < 0)
      g.in_place_cost_s =
          engine && cal.engine_in_place_copy_cost_s >= 0 ? cal.engine_in_place_copy_cost_s : g.copy_cost_s;
    if (g.in_place_copy_rate == 0 && engine) g.in_place_copy_rate = cal.engine_in_place_copy_rate;
    if (g.in_place_crowded_rate == 0 && engine && !g.gpu)
      g.in_place_crowded_rate = cal.engine_in_place_crowded_copy_rate;
    const NodeGroup measured = measured_node(cal, g.gpu);
    if (g.copy_rate == 0) g.copy_rate = measured.copy_rate;
    if (g.node_copy_rate == 0) g.node_copy_rate = measured.node_copy_rate;
    if (g.gpu) {
      // The engine's copies reach a share of the device copy's ceiling (many tensors, each its own
      // copy); measured on one GPU, the same share is assumed of NVLink's.
      const double share = engine && cal.engine_copy_rate > 0 && cal.device_copy_rate > 0
                               ? std::min(1.0, cal.engine_copy_rate / cal.device_copy_rate)
                               : 1.0;
      if (g.nvlink_rate == 0) g.nvlink_rate = cal.peer_copy_rate * share;
      if (g.pcie_rate == 0) g.pcie_rate = cal.pinned_copy_rate;
      if (g.pcie_duplex_rate == 0) g.pcie_duplex_rate = std::min(cal.duplex_pinned_copy_rate, g.pcie_rate);
      if (g.pcie_duplex_rate <= 0) g.pcie_duplex_rate = g.pcie_rate;
      need(g, g.copy_rate, "copy");
      if (g.node_copy_rate == 0) g.node_copy_rate = g.copy_rate;
    } else {
      if (g.cores == 0) g.cores = measured.cores;
      if (g.memory == 0) g.memory = cal.host_memory;
      if (g.row_cost_s == 0) g.row_cost_s = cal.row_cost_s;
      if (g.tcp_rate == 0) g.tcp_rate = cal.tcp_rate;
      need(g, g.copy_rate, "copy");
      if (g.node_copy_rate == 0) g.node_copy_rate = g.copy_rate * std::max(g.cores, 1);
      if (g.crowded_copy_rate == 0 && engine) g.crowded_copy_rate = cal.engine_crowded_copy_rate;
    }
    if (engine) fit_delta_costs(g, cal);
    if (g.in_place_copy_rate == 0) g.in_place_copy_rate = g.copy_rate;
  }
  if (cluster.transfer.read_rate == 0)
    cluster.transfer.read_rate = cluster.transfer.transport == "ucx"    ? cal.read_rate
                                 : cluster.transfer.transport == "nccl" ? cal.nccl_rate
                                                                        : 0;
  if (cluster.transfer.latency_s < 0) cluster.transfer.latency_s = std::max(cal.latency_s, 0.0);
  if (cluster.transfer.ack_latency_s < 0)
    cluster.transfer.ack_latency_s = cal.ack_latency_s >= 0 ? cal.ack_latency_s : cluster.transfer.latency_s;
  if (cluster.transfer.turnaround_s < 0) cluster.transfer.turnaround_s = std::max(cal.turnaround_s, 0.0);
  if (cluster.transfer.in_place_turnaround_s < 0)
    cluster.transfer.in_place_turnaround_s =
        cal.in_place_turnaround_s >= 0 ? cal.in_place_turnaround_s : cluster.transfer.turnaround_s;
  if (cluster.transfer.in_place_latency_s < 0)
    cluster.transfer.in_place_latency_s =
        cal.in_place_latency_s >= 0 ? cal.in_place_latency_s : cluster.transfer.latency_s;
  if (cluster.transfer.in_place_ack_latency_s < 0)
    cluster.transfer.in_place_ack_latency_s =
        cal.in_place_ack_latency_s >= 0 ? cal.in_place_ack_latency_s : cluster.transfer.ack_latency_s;
  if (cluster.transfer.overhead_s < 0) cluster.transfer.overhead_s = std::max(cal.overhead_s, 0.0);
}

}  // namespace refit
