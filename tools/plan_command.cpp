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
  const std::string path = options.model.empty() ? std::string(kDefaultModel) : options.model;
  const auto inventory = load_model_inventory(path);
  // Every worker of a local run shares this host's memory.
  std::vector<uint64_t> totals(options.sources + options.destinations, total_host_memory_bytes());
  const BucketSize size = resolve_bucket_size(config, totals);
  fmt::print("{}\n", bucket_size_line(size, config.device));
  const auto layouts = destination_layouts(path, inventory, config, options.parallel, options.destinations);
  const double full_bytes = static_cast<double>(inventory.total_bytes());

  nlohmann::json out = {{"model", inventory.name}, {"bucket_bytes", size.bytes}, {"full_bytes", inventory.total_bytes()},
                        {"destinations", nlohmann::json::array()}};
  fmt::print("{:>12} {:>7} {:>9} {:>12} {:>12} {:>8} {:>10}\n", "destination", "source", "tensors", "payload GiB",
             "wire GiB", "buckets", "reduction");
  for (int r = 0; r < options.destinations; ++r) {
    const int source = source_rank_for_destination(r, options.sources, options.destinations);
    const auto tensors = selected_tensors(inventory, layouts[r]);
    const BucketPlan plan = plan_buckets(tensors, size.bytes);
    const double reduction = plan.payload_bytes > 0 ? full_bytes / plan.payload_bytes : 0;
    fmt::print("{:>12} {:>7} {:>9} {:>12.3f} {:>12.3f} {:>8} {:>9.2f}x\n", r, source, tensors.size(),
               plan.payload_bytes / double(1ull << 30), plan.transferred_bytes / double(1ull << 30), plan.buckets.size(),
               reduction);
    out["destinations"].push_back({{"rank", r}, {"source", source}, {"tensors", tensors.size()},
                                   {"payload_bytes", plan.payload_bytes}, {"wire_bytes", plan.transferred_bytes},
                                   {"buckets", plan.buckets.size()}, {"reduction_vs_full", reduction}});
  }
  if (!options.json_path.empty()) {
    std::ofstream f(options.json_path);
    f << out.dump(2) << "\n";
    if (!f) throw Error(ErrorKind::kIo, fmt::format("cannot write --json file '{}'", options.json_path));
  }
  return 0;
}

}  // namespace refit::tools
