#include "bench.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "baseline.h"
#include "calibration_out.h"
#include "gpu_request.h"
#include "median.h"
#include "programs.h"
#include "refit/bucket_size.h"
#include "refit/config.h"
#include "refit/error.h"
#include "refit/fp8.h"
#include "refit/local_group.h"
#include "refit/memory.h"
#include "refit/model.h"
#include "refit/rank_group.h"
#include "refit/synchronizer.h"
#include "refit/tensor.h"
#include "timeline_json.h"
#include "verify.h"

namespace refit::tools {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

bool is_safetensors(const std::string& path) {
  if (fs::is_regular_file(path)) return fs::path(path).extension() == ".safetensors";
  if (!fs::is_directory(path) || fs::exists(fs::path(path) / "config.json")) return false;
  for (const auto& e : fs::directory_iterator(path))
    if (e.path().extension() == ".safetensors") return true;
  return false;
}

// Resharding: how many peers each side had and what each source sent (its egress).
void print_fan(const json& sources, const json& destinations) {
  auto range = [](const json& rows, const char* key) {
    uint64_t lo = UINT64_MAX, hi = 0;
    for (const auto& r : rows) {
      lo = std::min(lo, r.at(key).get<uint64_t>());
      hi = std::max(hi, r.at(key).get<uint64_t>());
    }
    return std::pair(lo, hi);
  };
  const auto [dlo, dhi] = range(destinations, "sources");
  const auto [slo, shi] = range(sources, "destinations");
  const auto [elo, ehi] = range(sources, "bytes");
  const auto [ilo, ihi] = range(destinations, "bytes");
  fmt::print(
      "resharding: each destination reads from {}..{} sources and receives {:.1f}..{:.1f} MiB (what it keeps); "
      "each source serves {}..{} destinations and sends {:.1f}..{:.1f} MiB\n",
      dlo, dhi, ilo / 1048576.0, ihi / 1048576.0, slo, shi, elo / 1048576.0, ehi / 1048576.0);
}

// Every worker's bucket events, in seconds since the driver started the refit.
json timeline_of(const RefitReport& report) {
  json events = json::array();
  for (const auto& w : report.workers) {
    append_timeline(events, fmt::format("{} {}", w.is_source ? "source" : "destination", w.rank),
                    w.is_source ? w.send.events : w.receive.events, report.start_time);
  }
  return events;
}

// Forwards every call to the group it wraps, and says what the driver is waiting for: on a
// terminal, a line on stderr as each set-up step starts (set-up of a large model takes seconds;
// each refit then shows as its row); everywhere, one line with the set-up's steps and times,
// printed before the first refit together with the table's header. Status lines are whole lines:
// the workers write to the same terminal.
class ProgressGroup final : public WorkerGroup {
 public:
  ProgressGroup(WorkerGroup& group, double start_seconds) : group_(group), tty_(isatty(STDERR_FILENO) == 1) {
    steps_.emplace_back("start workers", start_seconds);
  }

  int train_world_size() const override { return group_.train_world_size(); }
  int rollout_world_size() const override { return group_.rollout_world_size(); }
  std::vector<uint64_t> total_memory_bytes() override {
    return step("memory query", "asking the workers for their memory", [&] { return group_.total_memory_bytes(); });
  }
  void create_engines(uint64_t bucket_bytes, const SessionId& session) override {
    step("engines", fmt::format("creating engines ({} MiB buckets)", bucket_bytes >> 20),
         [&] { group_.create_engines(bucket_bytes, session); });
  }
  std::vector<Metadata> prepare() override {
    return step("buffers", "allocating and registering transfer buffers", [&] { return group_.prepare(); });
  }
  void init_process_groups(std::span<const Metadata> metadata) override {
    step("connect", "connecting sources and destinations", [&] { group_.init_process_groups(metadata); });
  }
  RefitReport refit(uint64_t index) override {
    if (!header_printed_) {
      header_printed_ = true;
      double total = 0;
      std::string parts;
      for (const auto& [name, seconds] : steps_) {
        total += seconds;
        parts += fmt::format("{}{} {:.2f} s", parts.empty() ? "" : ", ", name, seconds);
      }
      fmt::print("set-up: {:.2f} s ({})\n", total, parts);
      fmt::print("{:>6} {:>10} {:>12} {:>14} {:>9}\n", "refit", "seconds", "GiB/dest", "GiB/s (all)", "verified");
      std::fflush(stdout);
    }
    return group_.refit(index);
  }
  void finalize() override { group_.finalize(); }

 private:
  // Runs one set-up call, saying so on a terminal, and times it.
  template <typename F>
  std::invoke_result_t<F> step(const std::string& name, const std::string& status, F&& call) {
    if (tty_ && !header_printed_) fmt::print(stderr, "[refit bench] {} ...\n", status);
    const auto start = std::chrono::steady_clock::now();
    struct Time {
      ProgressGroup& self;
      const std::string& name;
      std::chrono::steady_clock::time_point start;
      ~Time() {
        if (!self.header_printed_)
          self.steps_.emplace_back(name,
                                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
    } time{*this, name, start};
    return call();
  }

  WorkerGroup& group_;
  bool tty_;
  bool header_printed_ = false;
  std::vector<std::pair<std::string, double>> steps_;  // set-up steps and their seconds
};

// Median seconds of `refits` refits of a local group, every one verified.
double timed_refits(const RefitConfig& config, GroupOptions options, int refits, const char* what,
                    uint64_t model_bytes) {
  LocalProcessGroup group(std::move(options));
  WeightSynchronizer sync(config, group);
  sync.set_model_bytes(model_bytes);
  std::vector<double> seconds;
  for (int k = 0; k < refits; ++k) {
    RefitReport report = sync.sync_weights();
    auto problems = verify(report);
    if (!problems.empty())
      throw Error(ErrorKind::kIntegrity, fmt::format("{}: refit {} did not verify: {}", what, k, problems.front()));
    seconds.push_back(report.seconds);
  }
  return median(seconds);
}

}  // namespace

// The config of a bench run: the file, then --device as overrides (a GPU device also picks
// CUDA_IPC, the backend that moves GPU memory between local processes), then the command line's
// own overrides, which win.
RefitConfig bench_config(const BenchOptions& options) {
  std::vector<std::string> overrides;
  if (!options.device.empty()) {
    overrides.push_back("refit_cfg.nixl.device=" + options.device);
    if (parse_device(options.device, "--device").kind == Device::Kind::kCuda)
      overrides.push_back("refit_cfg.nixl.backend_name=CUDA_IPC");
  }
  overrides.insert(overrides.end(), options.overrides.begin(), options.overrides.end());
  RefitConfig config = load_config(options.config_file, overrides);
  // --calibration-out measures the path the run takes: a run that reads in place (direct_reads, the
  // default) gives the in-place values, one with refit_cfg.nixl.direct_reads=false the bucket
  // path's (scripts/calibrate.sh runs both).
  return config;
}

MemoryKind bench_tensors(const BenchOptions& options, const RefitConfig& config) {
  if (options.tensors.empty()) return config.device.kind == Device::Kind::kCuda ? MemoryKind::kCuda : MemoryKind::kHost;
  if (options.tensors == "cpu") return MemoryKind::kHost;
  if (options.tensors == "cuda") return MemoryKind::kCuda;
  throw Error(ErrorKind::kInvalidArgument, fmt::format("--tensors '{}': expected cpu or cuda", options.tensors));
}

std::string model_option(const std::string& model) {
  if (model.empty()) return kDefaultModel;
  std::error_code ec;
  if (!model.starts_with("builtin:") && !fs::exists(model, ec))
    throw Error(ErrorKind::kModel,
                fmt::format("--model '{}' does not exist; give a config.json (or its directory), a .safetensors file "
                            "or a directory of them, or {}",
                            model, kDefaultModel));
  return model;
}

ModelInventory load_model(const std::string& path, bool fp8) {
  ModelInventory inventory = load_model_inventory(path);
  return fp8 ? fp8_block_inventory(inventory) : inventory;
}

namespace {

// The *.safetensors files of a --versions folder, in name order; at least one per refit.
std::vector<std::string> version_files(const std::string& folder, int refits) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(folder))
    throw Error(ErrorKind::kModel, fmt::format("--versions '{}' is not a folder of .safetensors files", folder));
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(folder))
    if (e.path().extension() == ".safetensors") files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  if (files.size() < static_cast<size_t>(std::max(refits, 1)))
    throw Error(ErrorKind::kModel, fmt::format("--versions '{}' holds {} .safetensors files, fewer than --refits {}",
                                               folder, files.size(), refits));
  return files;
}

}  // namespace

int run_bench(const BenchOptions& options) {
  const RefitConfig config = bench_config(options);
  BenchModel model;
  model.tensors = bench_tensors(options, config);
  check_gpu_request(gpu_request(options, config, model.tensors), config.device);
  if (!options.versions.empty() && !options.model.empty())
    throw Error(ErrorKind::kInvalidArgument, "--versions names the model itself: leave out --model");
  if (!options.versions.empty()) model.versions = version_files(options.versions, options.refits);
  const std::string path = model.versions.empty() ? model_option(options.model) : model.versions.front();
  model.inventory = load_model(path, options.fp8);
  if (is_safetensors(path)) model.safetensors_path = path;
  if (!(options.changed >= 0 && options.changed <= 1))
    throw Error(ErrorKind::kInvalidArgument, fmt::format("--changed must be in [0, 1], got {}", options.changed));
  model.changed_share = options.changed;
  std::optional<KillPoint> kill;
  if (!options.kill.empty()) kill = parse_kill_point(options.kill);
  const auto layouts = destination_layouts(path, model.inventory, config, options.parallel, options.destinations);
  check_paired(options.source_parallel, options.sources, options.destinations);
  const auto holds = source_layouts(path, model.inventory, options.source_parallel, options.sources);
  if (options.refits < 1)
    throw Error(ErrorKind::kInvalidArgument, fmt::format("--refits must be >= 1, got {}", options.refits));
  if (kill) {
    const int workers = kill->source ? options.sources : options.destinations;
    if (kill->rank >= workers || kill->refit >= static_cast<uint64_t>(options.refits))
      throw Error(ErrorKind::kInvalidArgument,
                  fmt::format("--kill '{}': this bench has {} {}(s) and refits 0 to {}", options.kill, workers,
                              kill->source ? "source" : "destination", options.refits - 1));
  }
  // How many steps the killed worker's refit had (its tensors, or its batches), to say so when the
  // kill point lies past them.
  std::optional<uint64_t> kill_steps;

  GroupOptions group_options;
  group_options.config = config;
  group_options.sources = options.sources;
  group_options.destinations = options.destinations;
  group_options.model_fingerprint = model.inventory.fingerprint();
  group_options.program = bench_programs(model, layouts, holds, kill);
  group_options.destination_layouts = layouts;
  if (!holds.empty()) {
    group_options.source_layouts = holds;
    group_options.model = std::make_shared<const ModelInventory>(model.inventory);
  }
  // Under a launcher, every rank runs this same command: rank 0 drives and reports, the others
  // serve their worker.
  std::optional<RankEnvironment> ranks;
  if (options.launcher == "env") {
    ranks = rank_environment(options.rendezvous);
    ranks->join_timeout_s = options.join_timeout_s;
    if (ranks->rank != 0) return serve_rank(group_options, *ranks);
  } else if (options.launcher != "local") {
    throw Error(ErrorKind::kInvalidArgument, fmt::format("--launcher '{}': expected local or env", options.launcher));
  } else if (!options.rendezvous.empty() || options.join_timeout_s > 0) {
    throw Error(ErrorKind::kInvalidArgument, "--rendezvous and --join-timeout need --launcher env");
  }

  // The model as the user named it (or the builtin's name); a config's architecture after it (a
  // safetensors inventory's name is only its file's).
  fmt::print(
      "refit bench: model {} ({}{} tensors, {:.2f} GiB{}), {} source(s) -> {} destination(s), {} refit(s); "
      "transfer buffers on {} ({}), tensors in {} memory\n",
      options.versions.empty() ? path : options.versions,
      model.safetensors_path.empty() ? model.inventory.name + ", " : "", model.inventory.tensors.size(),
      model.inventory.total_bytes() / kGiB, model.safetensors_path.empty() ? ", synthetic content" : ", safetensors",
      options.sources, options.destinations, options.refits, to_string(config.device), config.backend_name,
      model.tensors == MemoryKind::kCuda ? "GPU" : "host");

  json out = {{"transport", config.backend_name},
              {"refit_transport", config.refit_transport},
              {"device", to_string(config.device)},
              {"tensor_memory", model.tensors == MemoryKind::kCuda ? "cuda" : "cpu"},
              {"sources", options.sources},
              {"destinations", options.destinations},
              {"launcher", options.launcher},
              {"model", model.inventory.name},
              {"model_bytes", model.inventory.total_bytes()},
              {"tensors", model.inventory.tensors.size()},
              {"release_after_refit", config.release_after_refit},
              {"refits", json::array()}};
  std::vector<uint64_t> expected_bytes;
  for (const auto& layout : layouts) {
    uint64_t bytes = 0;
    for (const auto& t : selected_tensors(model.inventory, layout)) bytes += t.nbytes();
    expected_bytes.push_back(bytes);
  }
  out["sharded"] = layouts.empty() ? false : layouts[0].has_value();
  out["resharding"] = !holds.empty();
  out["expected_bytes"] = expected_bytes;
  if (options.changed > 0) {
    // What every refit after the first changes (each tensor's share, as the weight stream changes it).
    uint64_t changed = 0;
    for (const auto& t : model.inventory.tensors) changed += BenchModel::changed_elements(t.numel(), options.changed);
    out["changed_share"] = options.changed;
    out["changed_elements"] = changed;
  }
  bool verified = true;
  int exit_code = 0;
  std::vector<double> throughputs;
  uint64_t bucket_bytes = 0;
  uint64_t all_received = 0, in_place_received = 0;  // over every refit
  // Delta refit: what the refits that sent changes delivered, and what crossed the wire for it.
  uint64_t delta_delivered = 0, delta_wire = 0;
  {
    const auto start = std::chrono::steady_clock::now();
    if (isatty(STDERR_FILENO) == 1)
      fmt::print(stderr, "[refit bench] starting {} worker processes ...\n", options.sources + options.destinations);
    std::unique_ptr<WorkerGroup> group;
    if (ranks) {
      auto rank_group = std::make_unique<RankGroup>(group_options, *ranks);
      out["hosts"] = rank_group->hosts();
      group = std::move(rank_group);
    } else {
      group = std::make_unique<LocalProcessGroup>(group_options);
    }
    ProgressGroup progress(*group, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    WeightSynchronizer sync(config, progress);
    sync.set_model_bytes(model.inventory.total_bytes());
    for (int k = 0; k < options.refits; ++k) {
      json entry = {{"index", k}};
      try {
        RefitReport report = sync.sync_weights();
        bucket_bytes = sync.bucket_size().bytes;
        auto problems = verify(report);
        uint64_t received = 0;
        json per_destination = json::array(), per_source = json::array();
        for (const auto& w : report.workers) {
          if (kill && kill->refit == static_cast<uint64_t>(k) && kill->source == w.is_source && kill->rank == w.rank)
            kill_steps = w.is_source ? w.send.tensors + w.send.dropped : w.receive.batches;
          if (w.is_source) {
            per_source.push_back({{"rank", w.rank},
                                  {"bytes", w.send.payload_bytes},
                                  {"destinations", w.send.destinations},
                                  {"buckets", w.send.buckets},
                                  {"replayed_buckets", w.send.replayed_buckets},
                                  {"delta_tensors", w.send.delta_tensors},
                                  {"delta_seconds", w.send.delta_seconds},
                                  {"seconds", w.send.seconds}});
            continue;
          }
          received += w.receive.payload_bytes;
          all_received += w.receive.payload_bytes;
          in_place_received += w.receive.in_place_bytes;
          if (w.receive.delta_tensors > 0) {
            delta_delivered += w.receive.payload_bytes;
            delta_wire += w.receive.wire_bytes;
          }
          const uint64_t expected = expected_bytes.at(w.rank);
          if (w.receive.payload_bytes != expected)
            problems.push_back(fmt::format("destination rank {} received {} bytes, its layout holds {}", w.rank,
                                           w.receive.payload_bytes, expected));
          per_destination.push_back({{"rank", w.rank},
                                     {"bytes", w.receive.payload_bytes},
                                     {"expected_bytes", expected},
                                     {"wire_bytes", w.receive.wire_bytes},
                                     {"in_place_bytes", w.receive.in_place_bytes},
                                     {"delta_tensors", w.receive.delta_tensors},
                                     {"delta_bytes", w.receive.delta_bytes},
                                     {"delta_seconds", w.receive.delta_seconds},
                                     {"tensors", w.receive.tensors},
                                     {"batches", w.receive.batches},
                                     {"receive_seconds", w.receive.receive_seconds()},
                                     {"load_seconds", w.receive.load_seconds},
                                     {"mapped", w.receive.mapped},
                                     {"buffer_bytes", w.receive.buffer_bytes},
                                     {"route", w.receive.route},
                                     {"sources", w.receive.sources}});
        }
        const double rate = received / report.seconds;
        throughputs.push_back(rate);
        if (k == 0 && !holds.empty()) print_fan(per_source, per_destination);
        entry.update({{"ok", true},
                      {"seconds", report.seconds},
                      {"bytes_received", per_destination},
                      {"bytes_sent", per_source},
                      {"throughput_bytes_per_s", rate},
                      {"verified", problems.empty()}});
        // Only --json and --calibration-out read it: with hundreds of sources a refit has ~100,000 events.
        if (!options.json_path.empty() || !options.calibration_out.empty()) entry["timeline"] = timeline_of(report);
        if (!problems.empty()) {
          verified = false;
          exit_code = 3;
          entry["verification_errors"] = problems;
          for (const auto& p : problems) spdlog::error("verification: {}", p);
        }
        fmt::print("{:>6} {:>10.3f} {:>12.3f} {:>14.2f} {:>9}\n", k, report.seconds,
                   received / kGiB / options.destinations, rate / kGiB, problems.empty() ? "yes" : "NO");
        std::fflush(stdout);  // a row per refit as it ends, also into a pipe or a file
      } catch (const Error& e) {
        verified = false;
        exit_code = 2;
        entry.update({{"ok", false},
                      {"error", e.what()},
                      {"error_kind", std::string(to_string(e.kind()))},
                      {"verified", false}});
        spdlog::error("refit {} failed: {}", k, e.what());
        out["refits"].push_back(entry);
        break;
      }
      out["refits"].push_back(entry);
    }
  }
  // A kill point no worker reached is a failure test that tested nothing.
  if (kill && kill_steps) {
    spdlog::error("--kill {}: nothing was killed: that refit of {} rank {} had {} {} (STEP counts from 0)",
                  options.kill, kill->source ? "source" : "destination", kill->rank, *kill_steps,
                  kill->source ? "tensors" : "batches");
    out["kill_missed"] = true;
    if (exit_code == 0) exit_code = 4;
  }
  out["bucket_bytes"] = bucket_bytes;
  out["verified"] = verified;
  out["median_throughput_bytes_per_s"] = median(throughputs);
  fmt::print("median throughput: {:.2f} GiB/s over {} refit(s); verified: {}{}\n", median(throughputs) / kGiB,
             throughputs.size(), verified ? "yes" : "no",
             in_place_received > 0 ? fmt::format("; {:.0f}% of the bytes read in place (direct_reads)",
                                                 100.0 * in_place_received / std::max<uint64_t>(all_received, 1))
                                   : "");
  if (delta_wire > 0)
    fmt::print("delta refits: {:.2f} MiB on the wire for {:.2f} MiB delivered (1/{:.1f})\n",
               delta_wire / double(1 << 20), delta_delivered / double(1 << 20),
               double(delta_delivered) / double(delta_wire));

  if (options.compare_paired) {
    if (holds.empty() || ranks)
      throw Error(ErrorKind::kInvalidArgument, "--compare-paired needs --src-* (resharding) and --launcher local");
    // The paired path: the shards gathered into one full copy per destination (timed as a refit
    // from the same sharded sources to destinations that keep everything, a stand-in for the
    // training side's all-gather), then each full copy sent to its paired destination.
    const std::vector<std::optional<Layout>> whole(options.destinations);
    GroupOptions gather = group_options;
    gather.config.shard_expert_weights = false;  // its destinations keep everything
    gather.destination_layouts = whole;
    gather.program = bench_programs(model, whole, holds, std::nullopt);
    const double gather_s = timed_refits(config, gather, options.refits, "the gather", model.inventory.total_bytes());
    GroupOptions paired = group_options;
    paired.sources = options.destinations;
    paired.source_layouts.clear();
    paired.model.reset();
    static const std::vector<Layout> kNoHolds;
    paired.program = bench_programs(model, layouts, kNoHolds, std::nullopt);
    const double paired_s =
        timed_refits(config, paired, options.refits, "the paired refit", model.inventory.total_bytes());
    const double reshard_s = median([&] {
      std::vector<double> v;
      for (const auto& r : out["refits"])
        if (r.value("ok", false)) v.push_back(r.at("seconds").get<double>());
      return v;
    }());
    fmt::print(
        "paired path: gather {:.3f} s + paired refit {:.3f} s = {:.3f} s; resharding {:.3f} s ({:.2f}x faster)\n",
        gather_s, paired_s, gather_s + paired_s, reshard_s, (gather_s + paired_s) / reshard_s);
    out["compare_paired"] = {{"gather_seconds", gather_s},
                             {"paired_seconds", paired_s},
                             {"paired_total_seconds", gather_s + paired_s},
                             {"resharding_seconds", reshard_s}};
  }
  if (options.baseline && bucket_bytes > 0) {
    auto tls = config.backend_init_params.count("tls") ? config.backend_init_params.at("tls") : "";
    Baseline b = measure_baseline(bucket_bytes, tls);
    json base = {{"memcpy_bytes_per_s", b.memcpy_bytes_per_s}, {"ucp_get_command", b.ucp_get_note}};
    const double refit_rate = median(throughputs) / options.destinations;  // one pair's rate
    fmt::print("baseline at {} MiB: memcpy {:.2f} GiB/s", bucket_bytes >> 20, b.memcpy_bytes_per_s / kGiB);
    if (b.ucp_get_bytes_per_s) {
      base["ucp_get_bytes_per_s"] = *b.ucp_get_bytes_per_s;
      base["ratio_to_ucp_get"] = refit_rate / *b.ucp_get_bytes_per_s;
      fmt::print(", ucp_get {:.2f} GiB/s\n", *b.ucp_get_bytes_per_s / kGiB);
    } else {
      fmt::print("\nucp_get baseline unavailable: {}\n", b.ucp_get_note);
    }
    base["ratio_to_memcpy"] = refit_rate / b.memcpy_bytes_per_s;
    base["all_cores_memcpy_bytes_per_s"] = b.all_cores_memcpy_bytes_per_s;
    base["strided_row_cost_s"] = b.row_cost_s;
    if (b.tcp_get_bytes_per_s) base["tcp_get_bytes_per_s"] = *b.tcp_get_bytes_per_s;
    if (b.message_latency_s) base["message_latency_s"] = *b.message_latency_s;
    out["baseline"] = base;
    fmt::print("refit per pair {:.2f} GiB/s = {:.2f} x memcpy", refit_rate / kGiB, refit_rate / b.memcpy_bytes_per_s);
    if (b.ucp_get_bytes_per_s) fmt::print(", {:.2f} x ucp_get", refit_rate / *b.ucp_get_bytes_per_s);
    fmt::print("\n");
  }
  if (!options.calibration_out.empty()) save_bench_calibration(options.calibration_out, out);
  if (!options.json_path.empty()) {
    std::ofstream f(options.json_path);
    f << out.dump(2) << "\n";
    if (!f) throw Error(ErrorKind::kIo, fmt::format("cannot write --json file '{}'", options.json_path));
  }
  return exit_code;
}

}  // namespace refit::tools
