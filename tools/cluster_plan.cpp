#include "cluster_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "bench.h"
#include "refit/bucket_size.h"
#include "refit/cluster.h"
#include "refit/config.h"
#include "refit/error.h"
#include "refit/model.h"
#include "refit/prediction.h"
#include "timeline_json.h"

namespace refit::tools {
namespace {

using nlohmann::json;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

ParallelOptions destination_parallel(const ClusterSide& side) {
  ParallelOptions p;
  auto get = [&](const char* key) { return side.parallel.count(key) ? side.parallel.at(key) : 1; };
  p.tp = get("tp");
  p.ep = get("ep");
  p.pp = get("pp");
  p.shard_dense = side.shard_dense;
  return p;
}

SourceParallelOptions source_parallel(const ClusterSide& side) {
  SourceParallelOptions p;
  auto get = [&](const char* key) { return side.parallel.count(key) ? side.parallel.at(key) : 0; };
  p.tp = get("tp");
  p.pp = get("pp");
  p.dp = get("dp");
  p.ep = get("ep");
  p.etp = get("etp");
  p.fsdp = get("fsdp");
  return p;
}

json events_json(const Prediction& p) {
  json events = json::array();
  for (const auto* side : {&p.sources, &p.destinations})
    for (const auto& w : *side) append_timeline(events, w.worker, w.events);
  return events;
}

json prediction_json(const Prediction& p) {
  json workers = json::array();
  for (const auto* side : {&p.sources, &p.destinations})
    for (const auto& w : *side) workers.push_back({{"worker", w.worker}, {"seconds", w.seconds}, {"bytes", w.bytes}});
  json demands = json::array();
  for (size_t i = 0; i < p.demands.size() && i < 20; ++i)
    demands.push_back({{"resource", p.demands[i].name},
                       {"seconds", p.demands[i].seconds},
                       {"bytes", p.demands[i].bytes},
                       {"capacity_bytes_per_s", p.demands[i].capacity}});
  return {{"seconds", p.seconds},
          {"gather_seconds", p.gather_seconds},
          {"overhead_seconds", p.overhead_seconds},
          {"bound", p.bound},
          {"bucket_bytes", p.bucket_bytes},
          {"buckets", p.buckets},
          {"in_place_bytes", p.in_place_bytes},
          {"workers", workers},
          {"demands", demands},
          {"timeline", events_json(p)}};
}

// Workers with the same time share a row: "destination 0-31  0.912 s  42.0 GiB".
void print_workers(const std::vector<PredictedWorker>& workers, const char* role) {
  for (size_t first = 0; first < workers.size();) {
    size_t last = first;
    auto same = [&](const PredictedWorker& a, const PredictedWorker& b) {
      return std::abs(a.seconds - b.seconds) <= 0.01 * b.seconds && a.bytes == b.bytes;  // within 1%
    };
    while (last + 1 < workers.size() && same(workers[last + 1], workers[first])) ++last;
    const std::string span = first == last ? std::to_string(first) : fmt::format("{}-{}", first, last);
    double lo = workers[first].seconds, hi = lo;
    for (size_t k = first; k <= last; ++k) {
      lo = std::min(lo, workers[k].seconds);
      hi = std::max(hi, workers[k].seconds);
    }
    const std::string time = lo == hi ? fmt::format("{:.3f} s", lo) : fmt::format("{:.3f}-{:.3f} s", lo, hi);
    fmt::print("  {:>12} {:<9} {:>15} {:>10.3f} GiB\n", role, span, time, workers[first].bytes / kGiB);
    first = last + 1;
  }
}

void print_prediction(const char* path, const Prediction& p) {
  fmt::print("{} path: {:.3f} s", path, p.seconds);
  if (p.gather_seconds > 0) fmt::print(" (gather {:.3f} s first)", p.gather_seconds);
  fmt::print("; {} buckets of up to {:.1f} MiB per link", p.buckets, p.bucket_bytes / 1048576.0);
  if (p.in_place_bytes > 0) fmt::print(" ({:.3f} GiB read in place)", p.in_place_bytes / kGiB);
  fmt::print("; overhead {:.3f} s\n", p.overhead_seconds);
  fmt::print("  bound: {}\n", p.bound);
  print_workers(p.sources, "sources");
  print_workers(p.destinations, "destinations");
  fmt::print("  busiest resources (bytes / capacity):\n");
  for (size_t i = 0; i < p.demands.size() && i < 4; ++i)
    fmt::print("    {:<48} {:>9.3f} s  {:>10.2f} GiB at {:.1f} GB/s\n", p.demands[i].name, p.demands[i].seconds,
               p.demands[i].bytes / kGiB, p.demands[i].capacity / 1e9);
}

}  // namespace

int run_cluster_plan(const PlanOptions& options) {
  Cluster cluster = load_cluster(options.cluster);
  Calibration calibration;
  for (const auto& path : options.calibrations) load_calibration(path, calibration);
  apply_calibration(cluster, calibration);
  const std::string path =
      !options.model.empty() || cluster.model.empty() ? model_option(options.model) : cluster.model;
  const auto inventory = load_model(path, options.fp8);
  std::vector<std::string> overrides = options.overrides;
  if (cluster.destinations.shard_experts) overrides.push_back("refit_cfg.nixl.shard_expert_weights=true");
  const RefitConfig config = load_config(options.config_file, overrides);
  if (cluster.transfer.bucket_bytes == 0) {
    // The engine's own sizing, from the smallest worker memory of either side.
    std::vector<uint64_t> totals;
    for (const auto* side : {&cluster.sources, &cluster.destinations}) {
      const uint64_t memory = cluster.group(side->nodes).memory;
      if (memory == 0 && !config.bucket_bytes)
        throw Error(ErrorKind::kConfig,
                    fmt::format("cluster '{}': give transfer.bucket, or the memory of node group '{}'", cluster.name,
                                side->nodes));
      totals.push_back(memory);
    }
    cluster.transfer.bucket_bytes = resolve_bucket_size(config, totals).bytes;
  }
  const auto maybe_needs = destination_layouts(path, inventory, config, destination_parallel(cluster.destinations),
                                               cluster.destinations.ranks);
  std::vector<Layout> needs;
  for (const auto& n : maybe_needs) needs.push_back(n.value_or(Layout{}));
  const auto holds = source_layouts(path, inventory, source_parallel(cluster.sources), cluster.sources.ranks);

  const NodeGroup& sg = cluster.group(cluster.sources.nodes);
  const NodeGroup& dg = cluster.group(cluster.destinations.nodes);
  fmt::print(
      "cluster {}: model {} ({:.2f} GiB), {} sources on '{}' ({} node(s) x {} {}), {} destinations on '{}'; "
      "{:.0f} MiB buckets, transport {}{}\n",
      cluster.name, inventory.name, inventory.total_bytes() / kGiB, cluster.sources.ranks, sg.name, sg.count,
      sg.workers, sg.gpu ? "GPUs" : "processes", cluster.destinations.ranks, dg.name,
      cluster.transfer.bucket_bytes / 1048576.0, cluster.transfer.transport,
      cluster.transfer.direct_reads ? "" : ", direct_reads off");
  json out = {{"cluster", cluster.name},
              {"model", inventory.name},
              {"model_bytes", inventory.total_bytes()},
              {"sources", cluster.sources.ranks},
              {"destinations", cluster.destinations.ranks},
              {"bucket_bytes", cluster.transfer.bucket_bytes},
              {"transport", cluster.transfer.transport},
              {"direct_reads", cluster.transfer.direct_reads},
              {"prediction", json::object()}};
  const Prediction refit = predict_refit(inventory, holds, needs, cluster);
  print_prediction(holds.empty() ? "refit (paired: the sources hold the whole model)" : "refit (resharding)", refit);
  out["prediction"]["refit"] = prediction_json(refit);
  if (!holds.empty()) {
    const Prediction paired = predict_paired(inventory, holds, needs, cluster);
    print_prediction("paired (the reference's topology)", paired);
    out["prediction"]["paired"] = prediction_json(paired);
    fmt::print("refit's path is {:.2f}x faster than the paired path here\n", paired.seconds / refit.seconds);
  }
  if (options.changed >= 0) {
    const DeltaPrediction delta = predict_delta(inventory, holds, needs, cluster, options.changed, refit);
    fmt::print(
        "delta refit, {:.2f}% of the elements changed: {:.3f} s ({:.3f} s comparing at the busiest source and "
        "{:.3f} s patching at the busiest destination, alone; {:.2f} MiB per destination), scheduled as the engine "
        "does, against {:.3f} s for the full refit: {}\n  bound: {}\n",
        options.changed * 100, delta.seconds, delta.scan_seconds, delta.patch_seconds, delta.wire_bytes / 1048576.0,
        delta.full_seconds,
        delta.pays ? fmt::format("delta pays, {:.1f}x faster", delta.full_seconds / delta.seconds)
                   : std::string("a full refit is faster here"),
        delta.transfer.bound);
    out["prediction"]["delta"] = {{"changed_share", options.changed},
                                  {"seconds", delta.seconds},
                                  {"scan_seconds", delta.scan_seconds},
                                  {"patch_seconds", delta.patch_seconds},
                                  {"timeline", prediction_json(delta.transfer)},
                                  {"wire_bytes", delta.wire_bytes},
                                  {"pays", delta.pays}};
  }
  if (!options.json_path.empty()) {
    std::ofstream f(options.json_path);
    f << out.dump() << "\n";
    if (!f) throw Error(ErrorKind::kIo, fmt::format("cannot write --json file '{}'", options.json_path));
  }
  return 0;
}

}  // namespace refit::tools
