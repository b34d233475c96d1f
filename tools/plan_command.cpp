#include "plan_command.h"

#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "bench.h"
#include "refit/bucket_size.h"
#include "refit/checkpoint_engine.h"
#include "refit/error.h"
#include "refit/memory.h"
#include "refit/model.h"
#include "refit/plan.h"

namespace refit::tools {

int run_plan(const PlanOptions& options) {
  const RefitConfig config = load_config(options.config_file, options.overrides);
  const auto inventory = load_model_inventory(options.model.empty() ? default_model_path() : options.model);
  // Every worker of a local run shares this host's memory.
  std::vector<uint64_t> totals(options.sources + options.destinations, total_host_memory_bytes());
  const BucketSize size = resolve_bucket_size(config, totals);
  fmt::print("{}\n", bucket_size_line(size, config.device));
  const BucketPlan plan = plan_buckets(inventory.tensors, size.bytes);

  nlohmann::json out = {{"model", inventory.name}, {"bucket_bytes", size.bytes}, {"destinations", nlohmann::json::array()}};
  fmt::print("{:>12} {:>8} {:>10} {:>14} {:>14} {:>10}\n", "destination", "source", "tensors", "payload GiB", "wire GiB", "buckets");
  for (int r = 0; r < options.destinations; ++r) {
    int source = source_rank_for_destination(r, options.sources, options.destinations);
    fmt::print("{:>12} {:>8} {:>10} {:>14.3f} {:>14.3f} {:>10}\n", r, source, inventory.tensors.size(),
               plan.payload_bytes / double(1ull << 30), plan.transferred_bytes / double(1ull << 30), plan.buckets.size());
    out["destinations"].push_back({{"rank", r}, {"source", source}, {"tensors", inventory.tensors.size()},
                                   {"payload_bytes", plan.payload_bytes}, {"wire_bytes", plan.transferred_bytes},
                                   {"buckets", plan.buckets.size()}, {"reduction_vs_full", 1.0}});
  }
  if (!options.json_path.empty()) {
    std::ofstream f(options.json_path);
    f << out.dump(2) << "\n";
    if (!f) throw Error(ErrorKind::kIo, fmt::format("cannot write --json file '{}'", options.json_path));
  }
  return 0;
}

}  // namespace refit::tools
