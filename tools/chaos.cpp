#include "chaos.h"

#include <signal.h>

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "programs.h"
#include "refit/local_group.h"
#include "refit/plan.h"
#include "refit/synchronizer.h"
#include "verify.h"

namespace refit::tools {
namespace {
const std::vector<Layout> kNoHolds;  // every source holds the whole model
}  // namespace

namespace {

using nlohmann::json;
using Seconds = std::chrono::duration<double>;

constexpr uint64_t kBucketBytes = 1 << 20;

// About 8 MiB in 60 tensors of mixed sizes and dtypes; some span buckets.
ModelInventory chaos_model() {
  ModelInventory m;
  m.name = "chaos";
  for (int i = 0; i < 60; ++i) {
    const DType dtype = i % 3 == 0 ? DType::kFloat32 : DType::kBFloat16;
    const int64_t rows = i % 10 == 0 ? 700 : 17 + 13 * (i % 7);
    m.tensors.push_back({fmt::format("model.layers.{}.w{}.weight", i / 6, i % 6), dtype, {rows, 256}});
  }
  return m;
}

// Buckets that complete at least one tensor, i.e. the loader's batches.
uint64_t batch_count(const ModelInventory& model) {
  auto plan = plan_buckets(model.tensors, kBucketBytes);
  uint64_t batches = 0;
  for (const auto& b : plan.buckets) {
    bool completes = std::any_of(b.chunks.begin(), b.chunks.end(), [&](const PlannedChunk& c) {
      return c.placement.tensor_offset + c.placement.size == model.tensors[c.tensor].nbytes();
    });
    batches += completes ? 1 : 0;
  }
  return batches;
}

enum class Point { kBeforeConnect, kSourcePack, kDestinationLoad, kBetweenBuckets };
const char* point_name(Point p) {
  switch (p) {
    case Point::kBeforeConnect:
      return "before connect";
    case Point::kSourcePack:
      return "mid-bucket (source packing)";
    case Point::kDestinationLoad:
      return "during load";
    case Point::kBetweenBuckets:
      return "between buckets";
  }
  return "?";
}

}  // namespace

int run_chaos(const ChaosOptions& options) {
  std::vector<std::string> overrides = {fmt::format("refit_cfg.nixl.bucket_bytes={}", kBucketBytes),
                                        fmt::format("refit_cfg.nixl.timeout_s={}", options.timeout_s)};
  overrides.insert(overrides.end(), options.overrides.begin(), options.overrides.end());
  const RefitConfig config = load_config("", overrides);
  BenchModel model;
  model.inventory = chaos_model();
  const uint64_t batches = batch_count(model.inventory);
  const std::vector<std::optional<Layout>> no_layouts;
  std::mt19937_64 rng(options.seed);

  json trials = json::array();
  int bad = 0;
  std::vector<double> detect;
  for (int t = 0; t < options.trials; ++t) {
    const auto point = static_cast<Point>(rng() % 4);
    const int rank = static_cast<int>(rng() % options.destinations);
    KillPoint kill;
    kill.refit = 1;
    kill.rank = rank;
    kill.source = point == Point::kSourcePack || (point == Point::kBeforeConnect && rng() % 2 == 0);
    kill.step = kill.source ? 1 + rng() % (model.inventory.tensors.size() - 1) : rng() % batches;
    kill.when = point == Point::kBetweenBuckets ? KillPoint::When::kAfterLoad
                : kill.source                   ? KillPoint::When::kPack
                                                : KillPoint::When::kLoad;
    const std::string victim = fmt::format("{} rank {}", kill.source ? "source" : "destination", rank);
    json trial = {{"trial", t}, {"point", point_name(point)}, {"victim", victim}, {"step", kill.step}};
    std::vector<std::string> problems;

    GroupOptions group_options;
    group_options.config = config;
    group_options.sources = options.sources;
    group_options.destinations = options.destinations;
    group_options.model_fingerprint = model.inventory.fingerprint();
    std::optional<KillPoint> in_refit;
    if (point != Point::kBeforeConnect) in_refit = kill;
    group_options.program = bench_programs(model, no_layouts, kNoHolds, in_refit);
    LocalProcessGroup group(group_options);
    WeightSynchronizer sync(config, group);

    if (point == Point::kBeforeConnect) {
      const int index = kill.source ? rank : options.sources + rank;
      ::kill(group.pids()[index], SIGKILL);
    } else {
      try {
        auto report = sync.sync_weights();
        auto p = verify(report);
        problems.insert(problems.end(), p.begin(), p.end());
      } catch (const Error& e) {
        problems.push_back(fmt::format("refit 0 (before the kill) failed: {}", e.what()));
      }
    }

    // The refit that loses a worker: it must fail, naming the lost worker and the phase, in time.
    const auto start = Clock::now();
    try {
      sync.sync_weights();
      problems.push_back("the refit that lost a worker reported success");
    } catch (const Error& e) {
      const double seconds = Seconds(Clock::now() - start).count();
      const std::string message = e.what();
      trial["detect_seconds"] = seconds;
      trial["error"] = message;
      detect.push_back(seconds);
      if (message.find(victim) == std::string::npos) problems.push_back("the error does not name " + victim);
      if (point != Point::kBeforeConnect && message.find("phase") == std::string::npos)
        problems.push_back("the error does not name the phase");
      if (seconds > options.timeout_s + 5) problems.push_back(fmt::format("detected only after {:.1f} s", seconds));
    }
    if (!sync.stale()) problems.push_back("the synchronizer is not stale after a failed refit");

    // Recovery: a replacement process, fresh metadata, a full refit, checked bitwise.
    try {
      auto replaced = group.replace_lost_workers();
      if (replaced != std::vector<std::string>{victim})
        problems.push_back(fmt::format("expected to replace {}, replaced {}", victim, fmt::join(replaced, ", ")));
      sync.shutdown();
      auto report = sync.sync_weights();
      auto p = verify(report);
      problems.insert(problems.end(), p.begin(), p.end());
      trial["recovered"] = p.empty();
    } catch (const Error& e) {
      problems.push_back(fmt::format("recovery failed: {}", e.what()));
      trial["recovered"] = false;
    }
    trial["ok"] = problems.empty();
    if (!problems.empty()) {
      ++bad;
      trial["problems"] = problems;
      fmt::print("trial {} ({} killed {}): FAILED\n", t, victim, point_name(point));
      for (const auto& p : problems) fmt::print("  - {}\n", p);
    }
    trials.push_back(trial);
  }
  std::sort(detect.begin(), detect.end());
  const double worst = detect.empty() ? 0 : detect.back();
  const double median = detect.empty() ? 0 : detect[detect.size() / 2];
  fmt::print("chaos: {} trials, {} failures detected, {} behaved; detection median {:.3f} s, worst {:.3f} s\n",
             options.trials, detect.size(), options.trials - bad, median, worst);
  fmt::print("{} passed, {} failed\n", options.trials - bad, bad);
  if (!options.json_path.empty()) {
    json out = {{"trials", options.trials},  {"seed", options.seed},
                {"detected", detect.size()}, {"behaved", options.trials - bad},
                {"detect_median_s", median}, {"detect_worst_s", worst},
                {"details", trials}};
    std::ofstream(options.json_path) << out.dump(2) << "\n";
  }
  return bad == 0 ? 0 : 4;
}

}  // namespace refit::tools
