#include "plan_command.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>

#include "bench.h"
#include "cluster_plan.h"
#include "refit/bucket_size.h"
#include "refit/checkpoint_engine.h"
#include "refit/config.h"
#include "refit/error.h"
#include "refit/memory.h"
#include "refit/model.h"
#include "refit/plan.h"
#include "refit/transfer_plan.h"

namespace refit::tools {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::string span_of(int first, int last) {
  return first == last ? std::to_string(first) : fmt::format("{}-{}", first, last);
}

// Resharding: the transfer plan from the sources' shards to the destinations, and what each side
// moves.
void print_transfer_plan(const PlanOptions& options, const ModelInventory& inventory,
                         const std::vector<Layout>& sources, const std::vector<std::optional<Layout>>& destinations,
                         nlohmann::json& out) {
  std::vector<Layout> needs;
  for (const auto& d : destinations) needs.push_back(d.value_or(Layout{}));
  const auto start = std::chrono::steady_clock::now();
  const TransferPlan plan = plan_transfers(inventory, sources, needs);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  size_t links = 0;
  for (uint32_t d = 0; d < plan.destination_count(); ++d) links += plan.sources_of(d).size();
  fmt::print("transfer plan: {} sources -> {} destinations, {} pieces over {} links, planned in {:.3f} s\n",
             sources.size(), destinations.size(), plan.pieces().size(), links, seconds);
  const double full = static_cast<double>(inventory.total_bytes());
  fmt::print("{:>12} {:>14} {:>12} {:>10}\n", "destination", "reads from", "ingress GiB", "reduction");
  out["transfer_plan"] = {{"pieces", plan.pieces().size()},
                          {"links", links},
                          {"plan_seconds", seconds},
                          {"destinations", nlohmann::json::array()},
                          {"sources", nlohmann::json::array()}};
  // Rows with the same numbers collapse into one.
  auto print_rows = [&](uint32_t count, auto numbers, auto print) {
    for (uint32_t first = 0; first < count;) {
      uint32_t last = first;
      while (last + 1 < count && numbers(last + 1) == numbers(first)) ++last;
      print(span_of(first, last), first);
      first = last + 1;
    }
  };
  print_rows(
      plan.destination_count(), [&](uint32_t d) { return std::pair(plan.sources_of(d).size(), plan.ingress()[d]); },
      [&](const std::string& span, uint32_t d) {
        fmt::print("{:>12} {:>14} {:>12.3f} {:>9.2f}x\n", span, fmt::format("{} sources", plan.sources_of(d).size()),
                   plan.ingress()[d] / kGiB, plan.ingress()[d] ? full / plan.ingress()[d] : 0);
      });
  for (uint32_t d = 0; d < plan.destination_count(); ++d)
    out["transfer_plan"]["destinations"].push_back(
        {{"rank", d}, {"sources", plan.sources_of(d)}, {"ingress_bytes", plan.ingress()[d]}});
  fmt::print("{:>12} {:>14} {:>12}\n", "source", "serves", "egress GiB");
  print_rows(
      plan.source_count(), [&](uint32_t s) { return std::pair(plan.destinations_of(s).size(), plan.egress()[s]); },
      [&](const std::string& span, uint32_t s) {
        fmt::print("{:>12} {:>14} {:>12.3f}\n", span, fmt::format("{} destinations", plan.destinations_of(s).size()),
                   plan.egress()[s] / kGiB);
      });
  for (uint32_t s = 0; s < plan.source_count(); ++s)
    out["transfer_plan"]["sources"].push_back(
        {{"rank", s}, {"destinations", plan.destinations_of(s)}, {"egress_bytes", plan.egress()[s]}});
  const auto [lo, hi] = std::minmax_element(plan.egress().begin(), plan.egress().end());
  fmt::print("egress per source: {:.3f} .. {:.3f} GiB; ingress total {:.3f} GiB\n", *lo / kGiB, *hi / kGiB,
             std::accumulate(plan.ingress().begin(), plan.ingress().end(), 0.0) / kGiB);
}

}  // namespace

int run_plan(const PlanOptions& options) {
  if (options.changed >= 0 && options.cluster.empty())
    throw Error(ErrorKind::kInvalidArgument,
                fmt::format("--changed predicts a delta refit on a cluster: give --cluster too"));
  if (!options.cluster.empty()) return run_cluster_plan(options);
  const RefitConfig config = load_config(options.config_file, options.overrides);
  const std::string path = model_option(options.model);
  const auto inventory = load_model(path, options.fp8);
  check_paired(options.source_parallel, options.sources, options.destinations);
  const auto layouts = destination_layouts(path, inventory, config, options.parallel, options.destinations);
  const auto sources = source_layouts(path, inventory, options.source_parallel, options.sources);
  // Bucket sizing takes the smallest total memory of any worker's transfer device: the target's
  // when given, else this host's (every worker of a local run shares it).
  const uint64_t memory = options.target_memory.empty() ? total_host_memory_bytes()
                                                        : parse_byte_count(options.target_memory, "--target-memory");
  std::vector<uint64_t> totals(options.sources + options.destinations, memory);
  const BucketSize size = resolve_bucket_size(config, totals, inventory.total_bytes());
  fmt::print("{}\n", bucket_size_line(size, config.device));
  const double full_bytes = static_cast<double>(inventory.total_bytes());

  nlohmann::json out = {{"model", inventory.name},
                        {"bucket_bytes", size.bytes},
                        {"full_bytes", inventory.total_bytes()},
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
    const int source = sources.empty() ? source_rank_for_destination(r, options.sources, options.destinations) : -1;
    const ParallelRank rank = parallel_rank(options.parallel, r);
    const auto tensors = selected_tensors(inventory, layouts[r]);
    const BucketPlan plan = plan_buckets(tensors, size.bytes);
    Row row{r,
            r,
            source,
            source,
            rank,
            rank,
            tensors.size(),
            plan.buckets.size(),
            plan.payload_bytes,
            plan.transferred_bytes};
    // Destinations that receive the same amounts share one row.
    // (Paired, each from the source of its rank, so those must follow on too; planned, from the plan's.)
    if (!rows.empty() && rows.back().same_numbers(row) && rows.back().last == r - 1 &&
        (source < 0 || rows.back().last_source == source - 1)) {
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
    out["destinations"].push_back(
        {{"rank", r},
         {"source", source},
         {"tp_rank", rank.tp},
         {"ep_rank", rank.ep},
         {"pp_rank", rank.pp},
         {"tensors", tensors.size()},
         {"payload_bytes", plan.payload_bytes},
         {"wire_bytes", plan.transferred_bytes},
         {"buckets", plan.buckets.size()},
         {"reduction_vs_full", plan.payload_bytes > 0 ? full_bytes / plan.payload_bytes : 0}});
  }
  fmt::print("{:>12} {:>9} {:>20} {:>9} {:>12} {:>12} {:>8} {:>10}\n", "destination", "source", "tp/ep/pp rank",
             "tensors", "payload GiB", "wire GiB", "buckets", "reduction");
  for (const Row& row : rows) {
    const auto r = [](const ParallelRank& p) { return fmt::format("{}/{}/{}", p.tp, p.ep, p.pp); };
    const std::string rank = row.first == row.last ? r(row.first_rank) : r(row.first_rank) + ".." + r(row.last_rank);
    fmt::print("{:>12} {:>9} {:>20} {:>9} {:>12.3f} {:>12.3f} {:>8} {:>9.2f}x\n", span_of(row.first, row.last),
               row.first_source < 0 ? std::string("(plan)") : span_of(row.first_source, row.last_source), rank,
               row.tensors, row.payload / kGiB, row.wire / kGiB, row.buckets,
               row.payload > 0 ? full_bytes / row.payload : 0);
  }
  fmt::print("{:>12} {:>9} {:>20} {:>9} {:>12.3f} {:>12.3f} {:>8} {:>10}\n", "total", "", "", total.tensors,
             total.payload / kGiB, total.wire / kGiB, total.buckets, "");
  if (!sources.empty()) print_transfer_plan(options, inventory, sources, layouts, out);
  out["total"] = {{"tensors", total.tensors},
                  {"payload_bytes", total.payload},
                  {"wire_bytes", total.wire},
                  {"buckets", total.buckets}};
  if (!options.json_path.empty()) {
    std::ofstream f(options.json_path);
    f << out.dump(2) << "\n";
    if (!f) throw Error(ErrorKind::kIo, fmt::format("cannot write --json file '{}'", options.json_path));
  }
  return 0;
}

}  // namespace refit::tools
