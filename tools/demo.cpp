#include "demo.h"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <sstream>

#include "programs.h"
#include "refit/error.h"
#include "refit/local_group.h"
#include "refit/synchronizer.h"
#include "verify.h"

namespace refit::tools {
namespace {
const std::vector<Layout> kNoHolds;  // every source holds the whole model
}  // namespace

using nlohmann::json;

std::vector<int> parse_sequence(const std::string& text) {
  std::vector<int> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    item.erase(std::remove_if(item.begin(), item.end(), ::isspace), item.end());
    if (item.empty()) continue;
    size_t used = 0;
    int n = 0;
    try {
      n = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size())
      throw Error(ErrorKind::kInvalidArgument, fmt::format("--sequence: '{}' is not a count", item));
    if (n < 1)
      throw Error(ErrorKind::kInvalidArgument,
                  fmt::format("--sequence: destination counts must be positive, got {}", n));
    out.push_back(n);
  }
  if (out.empty()) throw Error(ErrorKind::kInvalidArgument, fmt::format("--sequence must contain at least one count"));
  return out;
}

int run_elastic_demo(const ElasticOptions& options) {
  const auto sequence = parse_sequence(options.sequence);
  if (options.bucket_mb < 1 || options.tensor_mb < 1)
    throw Error(ErrorKind::kInvalidArgument, fmt::format("--bucket-mb and --tensor-mb must be >= 1"));
  std::vector<std::string> overrides = {"refit_cfg.nixl.release_after_refit=true",
                                        fmt::format("refit_cfg.nixl.bucket_bytes={}MiB", options.bucket_mb)};
  overrides.insert(overrides.end(), options.overrides.begin(), options.overrides.end());
  const RefitConfig config = load_config(options.config_file, overrides);

  // The reference's two tensors: a dense weight that spans buckets and a small router weight.
  BenchModel model;
  model.inventory.name = "elastic-demo";
  model.inventory.tensors = {{"dense.weight", DType::kInt32, {int64_t(options.tensor_mb) * (1 << 20) / 4}},
                             {"router.weight", DType::kInt32, {4096}}};
  const int sources = *std::max_element(sequence.begin(), sequence.end());
  const std::vector<std::optional<Layout>> no_layouts;

  GroupOptions group_options;
  group_options.config = config;
  group_options.sources = sources;
  group_options.destinations = sequence.front();
  group_options.model_fingerprint = model.inventory.fingerprint();
  group_options.program = bench_programs(model, no_layouts, kNoHolds, std::nullopt);
  LocalProcessGroup group(group_options);
  WeightSynchronizer sync(config, group);
  fmt::print("ELASTIC_NIXL_POLICIES {}\n", json{{"count", sources}}.dump());

  int active = 0;
  for (size_t phase = 1; phase <= sequence.size(); ++phase) {
    const int target = sequence[phase - 1];
    json added = json::array(), removed = json::array();
    for (int r = target; r < active; ++r) removed.push_back(r);
    for (int r = active; r < target; ++r) added.push_back(r);
    if (active != 0) group.set_destinations(target);
    active = target;
    fmt::print("ELASTIC_NIXL_PHASE {}\n",
               json{{"phase", phase}, {"target_rollouts", target}, {"added", added}, {"removed", removed}}.dump());
    std::fflush(stdout);
    RefitReport report = sync.sync_weights();  // release_after_refit: finalize after, fresh metadata next phase
    auto problems = verify(report);
    if (!problems.empty()) {
      std::string all;
      for (const auto& p : problems) all += "\n" + p;
      throw Error(ErrorKind::kIntegrity, fmt::format("rollout result mismatch in phase {}:{}", phase, all));
    }
    json send_s = json::array(), receive_s = json::array();
    for (const auto& w : report.workers) {
      if (w.is_source)
        send_s.push_back(w.send.seconds);
      else
        receive_s.push_back(w.receive.total_seconds);
    }
    fmt::print("ELASTIC_NIXL_RESULT {}\n", json{{"phase", phase},
                                                {"rollout_count", target},
                                                {"added", added},
                                                {"removed", removed},
                                                {"send_elapsed_s", send_s},
                                                {"receive_elapsed_s", receive_s},
                                                {"status", "ok"}}
                                               .dump());
    std::fflush(stdout);
  }
  fmt::print("ELASTIC_NIXL_DEMO_COMPLETED\n");
  return 0;
}

}  // namespace refit::tools
