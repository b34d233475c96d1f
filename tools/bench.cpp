#include "bench.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <tuple>
#include <thread>
#include <nlohmann/json.hpp>

#include "baseline.h"
#include "programs.h"
#include "verify.h"
#include "refit/bucket_size.h"
#include "refit/cluster.h"
#include "refit/memory.h"
#include "refit/config.h"
#include "refit/tensor.h"
#include "refit/timeline.h"
#include "refit/error.h"
#include "refit/local_group.h"
#include "refit/rank_group.h"
#include "refit/model.h"
#include "refit/synchronizer.h"

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

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
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
  fmt::print("resharding: each destination reads from {}..{} sources and receives {:.1f}..{:.1f} MiB (what it keeps); "
             "each source serves {}..{} destinations and sends {:.1f}..{:.1f} MiB\n",
             dlo, dhi, ilo / 1048576.0, ihi / 1048576.0, slo, shi, elo / 1048576.0, ehi / 1048576.0);
}

// Every worker's bucket events, in seconds since the driver started the refit.
json timeline_of(const RefitReport& report) {
  json events = json::array();
  for (const auto& w : report.workers) {
    const std::string worker = fmt::format("{} {}", w.is_source ? "source" : "destination", w.rank);
    for (const TimelineEvent& e : w.is_source ? w.send.events : w.receive.events)
      events.push_back({{"worker", worker}, {"phase", to_string(e.phase)}, {"peer", e.peer}, {"bucket", e.bucket},
                        {"start", e.start - report.start_time}, {"end", e.end - report.start_time}, {"bytes", e.bytes}});
  }
  return events;
}

// The driver's own share of a refit: from its start to the first bucket event, and from the last
// to its end (median over the refits that succeeded).
double control_overhead(const json& refits) {
  std::vector<double> v;
  for (const auto& r : refits) {
    if (!r.value("ok", false) || !r.contains("timeline") || r["timeline"].empty()) continue;
    double first = 1e300, last = 0;
    for (const auto& e : r["timeline"]) {
      first = std::min(first, e.at("start").get<double>());
      last = std::max(last, e.at("end").get<double>());
    }
    v.push_back(std::max(0.0, first) + std::max(0.0, r.at("seconds").get<double>() - last));
  }
  return median(v);
}

// The engine's own copy rates, from its packs and loads of 1 MiB or more in every refit that
// succeeded but the first (which also faults the buffers in): a copy that ran alone gives the
// rate of one core; while two or more ran at once (a source packing while its destination loads:
// small buckets), the sum of their rates is what the host sustains for all of them.
struct CopyRates {
  double alone = 0, together = 0, crowded = 0;  // 0: not seen; crowded: more copies than cores
  double overlapped = 0;                        // seconds during which copies overlapped
};
CopyRates engine_copy_rates(const json& refits) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  double alone_bytes = 0, alone_seconds = 0, together_bytes = 0, together_seconds = 0, crowded_bytes = 0,
         crowded_seconds = 0;
  for (size_t k = 1; k < refits.size(); ++k) {
    if (!refits[k].value("ok", false) || !refits[k].contains("timeline")) continue;
    std::vector<std::array<double, 3>> copies;  // start, end, rate
    for (const auto& e : refits[k]["timeline"]) {
      const std::string phase = e.at("phase").get<std::string>();
      const double a = e.at("start").get<double>(), b = e.at("end").get<double>(), n = e.at("bytes").get<double>();
      if ((phase == "pack" || phase == "load") && n >= (1 << 20) && b > a) copies.push_back({a, b, n / (b - a)});
    }
    // Sweep the copies' boundaries: each stretch between two has a set of copies running.
    std::vector<double> edges;
    for (const auto& c : copies) edges.insert(edges.end(), {c[0], c[1]});
    std::sort(edges.begin(), edges.end());
    for (size_t i = 0; i + 1 < edges.size(); ++i) {
      const double a = edges[i], b = edges[i + 1];
      if (b <= a) continue;
      int running = 0;
      double rate = 0;
      for (const auto& c : copies)
        if (c[0] <= a && c[1] >= b) {
          ++running;
          rate += c[2];
        }
      if (running == 1) {
        alone_bytes += rate * (b - a);
        alone_seconds += b - a;
      } else if (running > cores) {
        crowded_bytes += rate * (b - a);
        crowded_seconds += b - a;
      } else if (running > 1) {
        together_bytes += rate * (b - a);
        together_seconds += b - a;
      }
    }
  }
  const double all = alone_seconds + together_seconds + crowded_seconds;
  return {alone_seconds > 0 ? alone_bytes / alone_seconds : 0,
          together_seconds > 0.2 * all ? together_bytes / together_seconds : 0,
          crowded_seconds > 0.2 * all ? crowded_bytes / crowded_seconds : 0, together_seconds + crowded_seconds};
}

// The engine's hand-off latency: from a bucket's announcement until its destination starts on it
// (its read, or its load when mapped), over the buckets whose destination was idle by then (its
// previous load done). The mean, so that the scheduler's occasional stalls count.
double handoff_latency(const json& refits) {
  double total = 0;
  int count = 0;
  for (size_t k = 1; k < refits.size(); ++k) {
    if (!refits[k].value("ok", false) || !refits[k].contains("timeline")) continue;
    // (source, destination, bucket) -> announce time; (destination, source, bucket) -> first start.
    std::map<std::tuple<std::string, std::string, uint64_t>, double> announced, started, previous_done;
    for (const auto& e : refits[k]["timeline"]) {
      const std::string phase = e.at("phase").get<std::string>(), worker = e.at("worker").get<std::string>();
      const std::string peer = std::to_string(e.at("peer").get<uint64_t>());
      const uint64_t bucket = e.at("bucket").get<uint64_t>();
      if (phase == "announce") announced[{worker.substr(7), peer, bucket}] = e.at("start").get<double>();
      if (phase == "read" || phase == "load") {
        auto [it, fresh] = started.try_emplace({peer, worker.substr(12), bucket}, e.at("start").get<double>());
        if (!fresh) it->second = std::min(it->second, e.at("start").get<double>());
      }
      if (phase == "load") previous_done[{peer, worker.substr(12), bucket + 1}] = e.at("end").get<double>();
    }
    for (const auto& [key, at] : announced) {
      auto s = started.find(key);
      if (s == started.end()) continue;
      auto p = previous_done.find(key);
      if (p != previous_done.end() && p->second > at) continue;  // the destination was still busy
      total += std::max(0.0, s->second - at);
      ++count;
    }
  }
  return count > 0 ? total / count : -1;
}

// The acknowledgement's latency: from a destination releasing a bucket until its source sees it,
// over the buckets whose source was waiting for it (it had announced the next one already).
double acknowledgement_latency(const json& refits) {
  double total = 0;
  int count = 0;
  for (size_t k = 1; k < refits.size(); ++k) {
    if (!refits[k].value("ok", false) || !refits[k].contains("timeline")) continue;
    // (source rank, destination rank, bucket) -> time
    std::map<std::tuple<uint64_t, uint64_t, uint64_t>, double> released, seen, announced;
    for (const auto& e : refits[k]["timeline"]) {
      const std::string phase = e.at("phase").get<std::string>(), worker = e.at("worker").get<std::string>();
      const bool source = worker.starts_with("source ");
      const uint64_t rank = std::stoull(worker.substr(source ? 7 : 12)), peer = e.at("peer").get<uint64_t>();
      const uint64_t bucket = e.at("bucket").get<uint64_t>();
      const auto key = source ? std::tuple(rank, peer, bucket) : std::tuple(peer, rank, bucket);
      const double at = e.at("start").get<double>();
      if (phase == "release") (source ? seen : released)[key] = at;
      if (phase == "announce") announced[key] = at;
    }
    for (const auto& [key, at] : released) {
      auto s = seen.find(key);
      auto next = announced.find({std::get<0>(key), std::get<1>(key), std::get<2>(key) + 1});
      if (s == seen.end() || next == announced.end() || next->second > at) continue;
      total += std::max(0.0, s->second - at);
      ++count;
    }
  }
  return count > 0 ? total / count : -1;
}

// The destination's turnaround: from the end of one load to the start of the next on the same
// link, when that bucket had been announced before the first load ended (its bytes were
// waiting). The mean, over the buckets of every refit but the first.
double load_turnaround(const json& refits) {
  double total = 0;
  int count = 0;
  for (size_t k = 1; k < refits.size(); ++k) {
    if (!refits[k].value("ok", false) || !refits[k].contains("timeline")) continue;
    std::map<std::tuple<std::string, uint64_t, uint64_t>, std::pair<double, double>> loads;  // (worker, peer, bucket)
    std::map<std::pair<uint64_t, uint64_t>, double> announced;                               // (peer, bucket): source rank
    for (const auto& e : refits[k]["timeline"]) {
      const std::string phase = e.at("phase").get<std::string>(), worker = e.at("worker").get<std::string>();
      const uint64_t peer = e.at("peer").get<uint64_t>(), bucket = e.at("bucket").get<uint64_t>();
      if (phase == "load") loads[{worker, peer, bucket}] = {e.at("start").get<double>(), e.at("end").get<double>()};
      if (phase == "announce") announced[{std::stoull(worker.substr(7)), bucket}] = e.at("start").get<double>();
    }
    for (const auto& [key, load] : loads) {
      const auto& [worker, peer, bucket] = key;
      auto next = loads.find({worker, peer, bucket + 1});
      auto ready = announced.find({peer, bucket + 1});
      if (next == loads.end() || ready == announced.end() || ready->second > load.second) continue;
      total += std::max(0.0, next->second.first - load.second);
      ++count;
    }
  }
  return count > 0 ? total / count : -1;
}

// What this run measured, merged into the calibration file (its other values kept).
void save_bench_calibration(const std::string& path, const json& run) {
  Calibration c;
  if (std::filesystem::exists(path)) load_calibration(path, c);
  const std::string device = run.at("tensor_memory").get<std::string>();
  if (!c.engine_device.empty() && c.engine_device != device)
    throw Error(ErrorKind::kInvalidArgument, fmt::format("--calibration-out {}: it holds the engine's copy rates on {}, this "
                                                         "bench copies on {} (one file per kind of run)",
                                                         path, c.engine_device, device));
  c.engine_device = device;
  c.machine = fmt::format("{} cores, {:.0f} GiB, measured by refit bench", std::max(1u, std::thread::hardware_concurrency()),
                          total_host_memory_bytes() / kGiB);
  c.host_memory = total_host_memory_bytes();
  if (run.contains("baseline")) {
    const json& b = run["baseline"];
    c.host_copy_rate = b.at("memcpy_bytes_per_s").get<double>();
    c.host_node_copy_rate = b.at("all_cores_memcpy_bytes_per_s").get<double>();
    c.row_cost_s = b.at("strided_row_cost_s").get<double>();
    c.cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    if (b.contains("ucp_get_bytes_per_s")) c.read_rate = b["ucp_get_bytes_per_s"].get<double>();
    if (b.contains("message_latency_s")) c.latency_s = b["message_latency_s"].get<double>();
  }
  const CopyRates rates = engine_copy_rates(run["refits"]);
  // A run measures the rate its copies ran at: alone (when none ever overlapped), together, or
  // crowded; and the hand-offs when its links carried many buckets.
  if (rates.alone > 0 && rates.overlapped == 0) c.engine_copy_rate = rates.alone;
  if (rates.together > 0 && rates.crowded == 0) c.engine_node_copy_rate = rates.together;
  if (rates.crowded > 0) c.engine_crowded_copy_rate = rates.crowded;
  const double handoff = handoff_latency(run["refits"]);
  if (handoff >= 0 && run.value("bucket_bytes", uint64_t{0}) * 8 <= run.value("model_bytes", uint64_t{0}) &&
      rates.crowded == 0)
    c.latency_s = handoff;  // many buckets: a sample worth keeping
  const double turnaround = load_turnaround(run["refits"]);
  const bool many_buckets = run.value("bucket_bytes", uint64_t{0}) * 8 <= run.value("model_bytes", uint64_t{0});
  const double acknowledged = acknowledgement_latency(run["refits"]);
  if (acknowledged >= 0 && many_buckets && rates.crowded == 0) c.ack_latency_s = acknowledged;
  if (turnaround >= 0 && many_buckets && rates.crowded == 0) c.turnaround_s = turnaround;
  const double overhead = control_overhead(run["refits"]);
  if (overhead > 0) c.overhead_s = overhead;
  save_calibration(path, c);
  fmt::print("calibration {}: the engine's copies {:.2f} GB/s alone, {:.2f} GB/s together, {:.2f} GB/s with more than "
             "cores; memcpy {:.2f} GB/s; "
             "read {:.2f} GB/s; latency {:.1f} us (acknowledgement {:.1f} us); turnaround {:.1f} us; refit overhead "
             "{:.2f} ms\n",
             path, c.engine_copy_rate / 1e9, c.engine_node_copy_rate / 1e9, c.engine_crowded_copy_rate / 1e9,
             c.host_copy_rate / 1e9, c.read_rate / 1e9,
             std::max(c.latency_s, 0.0) * 1e6, std::max(c.ack_latency_s, 0.0) * 1e6, std::max(c.turnaround_s, 0.0) * 1e6, std::max(c.overhead_s, 0.0) * 1e3);
}

// Median seconds of `refits` refits of a local group, every one verified.
double timed_refits(const RefitConfig& config, GroupOptions options, int refits, const char* what) {
  LocalProcessGroup group(std::move(options));
  WeightSynchronizer sync(config, group);
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
  return load_config(options.config_file, overrides);
}

MemoryKind bench_tensors(const BenchOptions& options, const RefitConfig& config) {
  if (options.tensors.empty())
    return config.device.kind == Device::Kind::kCuda ? MemoryKind::kCuda : MemoryKind::kHost;
  if (options.tensors == "cpu") return MemoryKind::kHost;
  if (options.tensors == "cuda") return MemoryKind::kCuda;
  throw Error(ErrorKind::kInvalidArgument, fmt::format("--tensors '{}': expected cpu or cuda", options.tensors));
}

int run_bench(const BenchOptions& options) {
  const RefitConfig config = bench_config(options);
  BenchModel model;
  model.tensors = bench_tensors(options, config);
  const std::string path = options.model.empty() ? std::string(kDefaultModel) : options.model;
  model.inventory = load_model_inventory(path);
  if (is_safetensors(path)) model.safetensors_path = path;
  std::optional<KillPoint> kill;
  if (!options.kill.empty()) kill = parse_kill_point(options.kill);
  const auto layouts = destination_layouts(path, model.inventory, config, options.parallel, options.destinations);
  const auto holds = source_layouts(path, model.inventory, options.source_parallel, options.sources);
  if (options.refits < 1) throw Error(ErrorKind::kInvalidArgument, fmt::format("--refits must be >= 1, got {}", options.refits));

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
    if (ranks->rank != 0) return serve_rank(group_options, *ranks);
  } else if (options.launcher != "local") {
    throw Error(ErrorKind::kInvalidArgument, fmt::format("--launcher '{}': expected local or env", options.launcher));
  } else if (!options.rendezvous.empty()) {
    throw Error(ErrorKind::kInvalidArgument, "--rendezvous needs --launcher env");
  }

  fmt::print("refit bench: model {} ({} tensors, {:.2f} GiB{}), {} source(s) -> {} destination(s), {} refit(s); "
             "transfer buffers on {} ({}), tensors in {} memory\n",
             model.inventory.name, model.inventory.tensors.size(), model.inventory.total_bytes() / kGiB,
             model.safetensors_path.empty() ? ", synthetic content" : ", safetensors", options.sources,
             options.destinations, options.refits, to_string(config.device), config.backend_name,
             model.tensors == MemoryKind::kCuda ? "GPU" : "host");

  json out = {{"transport", config.backend_name}, {"refit_transport", config.refit_transport},
              {"device", to_string(config.device)}, {"tensor_memory", model.tensors == MemoryKind::kCuda ? "cuda" : "cpu"},
              {"sources", options.sources},
              {"destinations", options.destinations}, {"launcher", options.launcher}, {"model", model.inventory.name},
              {"model_bytes", model.inventory.total_bytes()}, {"tensors", model.inventory.tensors.size()},
              {"release_after_refit", config.release_after_refit}, {"refits", json::array()}};
  std::vector<uint64_t> expected_bytes;
  for (const auto& layout : layouts) {
    uint64_t bytes = 0;
    for (const auto& t : selected_tensors(model.inventory, layout)) bytes += t.nbytes();
    expected_bytes.push_back(bytes);
  }
  out["sharded"] = layouts.empty() ? false : layouts[0].has_value();
  out["resharding"] = !holds.empty();
  out["expected_bytes"] = expected_bytes;
  bool verified = true;
  int exit_code = 0;
  std::vector<double> throughputs;
  uint64_t bucket_bytes = 0;
  {
    std::unique_ptr<WorkerGroup> group;
    if (ranks) {
      auto rank_group = std::make_unique<RankGroup>(group_options, *ranks);
      out["hosts"] = rank_group->hosts();
      group = std::move(rank_group);
    } else {
      group = std::make_unique<LocalProcessGroup>(group_options);
    }
    WeightSynchronizer sync(config, *group);

    fmt::print("{:>6} {:>10} {:>12} {:>14} {:>9}\n", "refit", "seconds", "GiB/dest", "GiB/s (all)", "verified");
    for (int k = 0; k < options.refits; ++k) {
      json entry = {{"index", k}};
      try {
        RefitReport report = sync.sync_weights();
        bucket_bytes = sync.bucket_size().bytes;
        auto problems = verify(report);
        uint64_t received = 0;
        json per_destination = json::array(), per_source = json::array();
        for (const auto& w : report.workers) {
          if (w.is_source) {
            per_source.push_back({{"rank", w.rank}, {"bytes", w.send.payload_bytes}, {"destinations", w.send.destinations},
                                  {"buckets", w.send.buckets}, {"seconds", w.send.seconds}});
            continue;
          }
          received += w.receive.payload_bytes;
          const uint64_t expected = expected_bytes.at(w.rank);
          if (w.receive.payload_bytes != expected)
            problems.push_back(fmt::format("destination rank {} received {} bytes, its layout holds {}", w.rank,
                                           w.receive.payload_bytes, expected));
          per_destination.push_back({{"rank", w.rank}, {"bytes", w.receive.payload_bytes}, {"expected_bytes", expected},
                                     {"wire_bytes", w.receive.wire_bytes}, {"tensors", w.receive.tensors},
                                     {"batches", w.receive.batches}, {"receive_seconds", w.receive.receive_seconds()},
                                     {"load_seconds", w.receive.load_seconds}, {"mapped", w.receive.mapped},
                                     {"buffer_bytes", w.receive.buffer_bytes}, {"route", w.receive.route},
                                     {"sources", w.receive.sources}});
        }
        const double rate = received / report.seconds;
        throughputs.push_back(rate);
        if (k == 0 && !holds.empty()) print_fan(per_source, per_destination);
        entry.update({{"ok", true}, {"seconds", report.seconds}, {"bytes_received", per_destination},
                      {"bytes_sent", per_source},
                      {"throughput_bytes_per_s", rate}, {"verified", problems.empty()},
                      {"timeline", timeline_of(report)}});
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
        entry.update({{"ok", false}, {"error", e.what()}, {"error_kind", std::string(to_string(e.kind()))}, {"verified", false}});
        spdlog::error("refit {} failed: {}", k, e.what());
        out["refits"].push_back(entry);
        break;
      }
      out["refits"].push_back(entry);
    }
  }
  out["bucket_bytes"] = bucket_bytes;
  out["verified"] = verified;
  out["median_throughput_bytes_per_s"] = median(throughputs);
  fmt::print("median throughput: {:.2f} GiB/s over {} refit(s); verified: {}\n", median(throughputs) / kGiB,
             throughputs.size(), verified ? "yes" : "no");

  if (options.compare_paired) {
    if (holds.empty() || ranks)
      throw Error(ErrorKind::kInvalidArgument, "--compare-paired needs --src-* (resharding) and --launcher local");
    // The paired path: the shards gathered into one full copy per destination (timed as a refit
    // from the same sharded sources to destinations that keep everything, a stand-in for the
    // training side's all-gather), then each full copy sent to its paired destination.
    const std::vector<std::optional<Layout>> whole(options.destinations);
    GroupOptions gather = group_options;
    gather.destination_layouts = whole;
    gather.program = bench_programs(model, whole, holds, std::nullopt);
    const double gather_s = timed_refits(config, gather, options.refits, "the gather");
    GroupOptions paired = group_options;
    paired.sources = options.destinations;
    paired.source_layouts.clear();
    paired.model.reset();
    static const std::vector<Layout> kNoHolds;
    paired.program = bench_programs(model, layouts, kNoHolds, std::nullopt);
    const double paired_s = timed_refits(config, paired, options.refits, "the paired refit");
    const double reshard_s = median([&] {
      std::vector<double> v;
      for (const auto& r : out["refits"])
        if (r.value("ok", false)) v.push_back(r.at("seconds").get<double>());
      return v;
    }());
    fmt::print("paired path: gather {:.3f} s + paired refit {:.3f} s = {:.3f} s; resharding {:.3f} s ({:.2f}x faster)\n",
               gather_s, paired_s, gather_s + paired_s, reshard_s, (gather_s + paired_s) / reshard_s);
    out["compare_paired"] = {{"gather_seconds", gather_s}, {"paired_seconds", paired_s},
                             {"paired_total_seconds", gather_s + paired_s}, {"resharding_seconds", reshard_s}};
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
