#include "plan_command.h"

#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "bench.h"
#include "refit/bucket_size.h"
#include "refit/checkpoint_engine.h"
#include "refit/config.h"
#include "refit/error.h"
#include "refit/memory.h"
#include "refit/model.h"
#include "refit/plan.h"

namespace refit::tools {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::string span_of(int first, int last) { return first == last ? std::to_string(first) : fmt::format("{}-{}", first, last); }

}  // namespace

int run_plan(const PlanOptions& options) {
  const RefitConfig config = load_config(options.config_file, options.overrides);
  const std::string path = options.model.empty() ? std::string(kDefaultModel) : options.model;
  const auto inventory = load_model_inventory(path);
  // Bucket sizing takes the smallest total memory of any worker's transfer device: the target's
  // when given, else this host's (every worker of a local run shares it).
  const uint64_t memory =
      options.target_memory.empty() ? total_host_memory_bytes() : parse_byte_count(options.target_memory, "--target-memory");
  std::vector<uint64_t> totals(options.sources + options.destinations, memory);
  const BucketSize size = resolve_bucket_size(config, totals);
  fmt::print("{}\n", bucket_size_line(size, config.device));
  const auto layouts = destination_layouts(path, inventory, config, options.parallel, options.destinations);
  const double full_bytes = static_cast<double>(inventory.total_bytes());

  nlohmann::json out = {{"model", inventory.name}, {"bucket_bytes", size.bytes}, {"full_bytes", inventory.total_bytes()},
                        {"destinations", nlohmann::json::array()}};
  struct Row {
    int first = 0, last = 0, first_source = 0, last_source = 0;
    ParallelRank first_rank, last_rank;
    size_t tensors = 0, buckets = 0;
    uint64_t payload = 0, wire = 0;
    bool same_numbers(const Row& o) const {
      return tensors == o.tensors && buckets == o.buckets && payload == o.payload && wire == o.wire;
    }
  };
  std::vector<Row> rows;
  Row total;
  for (int r = 0; r < options.destinations; ++r) {
    const int source = source_rank_for_destination(r, options.sources, options.destinations);
    const ParallelRank rank = parallel_rank(options.parallel, r);
    const auto tensors = selected_tensors(inventory, layouts[r]);
    const BucketPlan plan = plan_buckets(tensors, size.bytes);
    Row row{r, r, source, source, rank, rank, tensors.size(), plan.buckets.size(), plan.payload_bytes,
            plan.transferred_bytes};
    // Destinations that receive the same amounts share one row.
    if (!rows.empty() && rows.back().same_numbers(row) && rows.back().last == r - 1 && rows.back().last_source == source - 1) {
      rows.back().last = r;
      rows.back().last_source = source;
      rows.back().last_rank = rank;
    } else {
      rows.push_back(row);
    }
    total.tensors += row.tensors;
    total.buckets += row.buckets;
    total.payload += row.payload;
    total.wire += row.wire;
    out["destinations"].push_back({{"rank", r}, {"source", source}, {"tp_rank", rank.tp}, {"ep_rank", rank.ep},
                                   {"pp_rank", rank.pp}, {"tensors", tensors.size()}, {"payload_bytes", plan.payload_bytes},
                                   {"wire_bytes", plan.transferred_bytes}, {"buckets", plan.buckets.size()},
                                   {"reduction_vs_full", plan.payload_bytes > 0 ? full_bytes / plan.payload_bytes : 0}});
  }
  fmt::print("{:>12} {:>9} {:>20} {:>9} {:>12} {:>12} {:>8} {:>10}\n", "destination", "source", "tp/ep/pp rank", "tensors",
             "payload GiB", "wire GiB", "buckets", "reduction");
  for (const Row& row : rows) {
    const auto r = [](const ParallelRank& p) { return fmt::format("{}/{}/{}", p.tp, p.ep, p.pp); };
    const std::string rank = row.first == row.last ? r(row.first_rank) : r(row.first_rank) + ".." + r(row.last_rank);
    fmt::print("{:>12} {:>9} {:>20} {:>9} {:>12.3f} {:>12.3f} {:>8} {:>9.2f}x\n", span_of(row.first, row.last),
               span_of(row.first_source, row.last_source), rank, row.tensors, row.payload / kGiB, row.wire / kGiB,
               row.buckets, row.payload > 0 ? full_bytes / row.payload : 0);
  }
  fmt::print("{:>12} {:>9} {:>20} {:>9} {:>12.3f} {:>12.3f} {:>8} {:>10}\n", "total", "", "", total.tensors,
             total.payload / kGiB, total.wire / kGiB, total.buckets, "");
  out["total"] = {{"tensors", total.tensors}, {"payload_bytes", total.payload}, {"wire_bytes", total.wire},
                  {"buckets", total.buckets}};
  if (!options.json_path.empty()) {
    std::ofstream f(options.json_path);
    f << out.dump(2) << "\n";
    if (!f) throw Error(ErrorKind::kIo, fmt::format("cannot write --json file '{}'", options.json_path));
  }
  return 0;
}

}  // namespace refit::tools
