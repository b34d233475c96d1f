#include "parallel_options.h"

#include <CLI/CLI.hpp>

#include <filesystem>

#include "core/fail.h"
#include "refit/layout_builders.h"

namespace refit::tools {

void ParallelOptions::add_to(CLI::App& command) {
  command.add_option("--tp", tp, "Destination tensor-parallel size")->capture_default_str();
  command.add_option("--ep", ep, "Destination expert-parallel size")->capture_default_str();
  command.add_option("--pp", pp, "Destination pipeline-parallel size")->capture_default_str();
  command.add_flag("--shard-dense", shard_dense, "Send each destination only its TP slice of dense tensors");
}

ParallelRank parallel_rank(const ParallelOptions& p, int r) { return {r % p.tp, (r / p.tp) % p.ep, r / (p.tp * p.ep)}; }

std::vector<std::optional<Layout>> destination_layouts(const std::string& model_path, const ModelInventory& inventory,
                                                       const RefitConfig& config, const ParallelOptions& p,
                                                       int destinations) {
  std::vector<std::optional<Layout>> out(destinations);
  const bool sharded = config.shard_expert_weights || p.shard_dense;
  const bool parallel = p.tp * p.ep * p.pp > 1;
  if (p.tp < 1 || p.ep < 1 || p.pp < 1)
    fail(ErrorKind::kTopology, "--tp, --ep and --pp must be >= 1, got {}, {}, {}", p.tp, p.ep, p.pp);
  if (!sharded) {
    if (parallel)
      fail(ErrorKind::kConfig,
           "--tp/--ep/--pp describe sharded destinations, but nothing is sharded: set "
           "refit_cfg.nixl.shard_expert_weights=true and/or --shard-dense");
    return out;
  }
  if (p.tp * p.ep * p.pp != destinations)
    fail(ErrorKind::kTopology, "--tp {} x --ep {} x --pp {} = {} destination ranks, but --destinations is {}", p.tp, p.ep,
         p.pp, p.tp * p.ep * p.pp, destinations);
  namespace fs = std::filesystem;
  std::string config_json = model_path;
  if (fs::is_directory(model_path)) config_json = (fs::path(model_path) / "config.json").string();
  if (!model_path.starts_with("builtin:") && (!fs::exists(config_json) || fs::path(config_json).extension() != ".json"))
    fail(ErrorKind::kModel, "sharded layouts need the model's config.json (head counts), not found for '{}'", model_path);
  const ModelDims dims = model_dims_from_hf_config(config_json);
  for (int r = 0; r < destinations; ++r) {
    const ParallelRank rank = parallel_rank(p, r);
    ModelParallel mp;
    mp.destination_rank = r;
    mp.tp_size = p.tp;
    mp.tp_rank = rank.tp;
    mp.ep_size = p.ep;
    mp.ep_rank = rank.ep;
    mp.expert_tp_size = p.tp;  // experts are TP-sliced within their EP group
    mp.expert_tp_rank = rank.tp;
    mp.pp_size = p.pp;
    mp.pp_rank = rank.pp;
    mp.shard_experts = config.shard_expert_weights;
    mp.shard_dense = p.shard_dense;
    out[r] = build_layout(inventory, dims, mp);
    validate_layout(*out[r], inventory, r);
  }
  return out;
}

std::vector<TensorInfo> selected_tensors(const ModelInventory& inventory, const std::optional<Layout>& layout) {
  if (!layout) return inventory.tensors;
  std::vector<TensorInfo> out;
  for (const auto& t : inventory.tensors) {
    Selection s = select(*layout, t);
    if (s.take != Take::kDrop) out.push_back(std::move(s.info));
  }
  return out;
}

}  // namespace refit::tools
