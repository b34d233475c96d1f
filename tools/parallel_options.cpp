#include "parallel_options.h"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <filesystem>

#include "refit/error.h"
#include "refit/layout_builders.h"

namespace refit::tools {

void ParallelOptions::add_to(CLI::App& command) {
  command.add_option("--tp", tp, "Destination tensor-parallel size")->capture_default_str();
  command.add_option("--ep", ep, "Destination expert-parallel size")->capture_default_str();
  command.add_option("--pp", pp, "Destination pipeline-parallel size")->capture_default_str();
  command.add_flag("--shard-dense", shard_dense, "Send each destination only its TP slice of dense tensors");
}

void SourceParallelOptions::add_to(CLI::App& command) {
  command.add_option("--src-tp", tp, "Sources hold Megatron tensor-parallel shards of this size (resharding)");
  command.add_option("--src-pp", pp, "Sources are split into this many Megatron pipeline stages");
  command.add_option("--src-dp", dp,
                     "Data-parallel replicas among the sources (default, as Megatron derives it: --sources / "
                     "(--src-tp x --src-pp))");
  command.add_option("--src-ep", ep, "Sources split routed experts over this many expert-parallel ranks per stage");
  command.add_option("--src-etp", etp, "Expert tensor-parallel size of the sources (default: --src-tp)");
  command.add_option("--src-fsdp", fsdp, "Sources hold FSDP2 shards (Shard(0) of every tensor) over this many ranks");
}

namespace {

std::string config_json_of(const std::string& model_path) {
  namespace fs = std::filesystem;
  std::string config_json = model_path;
  if (fs::is_directory(model_path)) config_json = (fs::path(model_path) / "config.json").string();
  if (!model_path.starts_with("builtin:") && (!fs::exists(config_json) || fs::path(config_json).extension() != ".json"))
    throw Error(
        ErrorKind::kModel,
        fmt::format("sharded layouts need the model's config.json (head counts), not found for '{}'", model_path));
  return config_json;
}

}  // namespace

void check_paired(const SourceParallelOptions& p, int sources, int destinations) {
  // The engine's own refusal (source_rank_for_destination) names no option that helps.
  if (!p.given() && sources < destinations)
    throw Error(
        ErrorKind::kTopology,
        fmt::format(
            "--sources {} < --destinations {}: without --src-* every destination reads the whole model from its own "
            "source; for fewer sources, say what each holds (--src-tp/--src-pp/--src-dp/--src-ep/--src-etp, or "
            "--src-fsdp) and what each destination keeps (--tp/--pp/--ep)",
            sources, destinations));
}

std::vector<Layout> source_layouts(const std::string& model_path, const ModelInventory& inventory,
                                   const SourceParallelOptions& p, int sources) {
  if (!p.given()) return {};
  if (p.fsdp) {
    if (p.tp || p.pp || p.dp || p.ep || p.etp)
      throw Error(ErrorKind::kConfig,
                  fmt::format("--src-fsdp describes the sources alone: leave out --src-tp/--src-pp/--src-dp/--src-ep"));
    if (p.fsdp != sources)
      throw Error(ErrorKind::kTopology,
                  fmt::format("--src-fsdp {} describes {} sources, but --sources is {}", p.fsdp, p.fsdp, sources));
    std::vector<Layout> out;
    for (int r = 0; r < sources; ++r) out.push_back(fsdp_source_layout(inventory, sources, r));
    return out;
  }
  TrainingParallel t;
  t.tp_size = std::max(1, p.tp);
  t.pp_size = std::max(1, p.pp);
  t.ep_size = std::max(1, p.ep);
  if (p.etp) t.expert_tp_size = p.etp;
  // As Megatron: the data-parallel size is what the world size leaves, and must divide it exactly.
  const int model_parallel = t.tp_size * t.pp_size;
  if (sources % model_parallel != 0)
    throw Error(
        ErrorKind::kTopology,
        fmt::format(
            "--sources {} is not a multiple of --src-tp {} x --src-pp {} = {}: the data-parallel size, as Megatron "
            "derives it, is --sources / (tp x pp)",
            sources, t.tp_size, t.pp_size, model_parallel));
  t.dp_size = sources / model_parallel;
  if (p.dp && p.dp != t.dp_size)
    throw Error(
        ErrorKind::kTopology,
        fmt::format(
            "--src-dp {} disagrees with --sources {} / (--src-tp {} x --src-pp {}) = {}: leave --src-dp out, or make "
            "--src-tp x --src-dp x --src-pp equal --sources",
            p.dp, sources, t.tp_size, t.pp_size, t.dp_size));
  return megatron_source_layouts(inventory, model_dims_from_hf_config(config_json_of(model_path)), t);
}

// Ranks past tp x ep x pp are data-parallel replicas: the same ranks again.
ParallelRank parallel_rank(const ParallelOptions& p, int r) {
  return {r % p.tp, (r / p.tp) % p.ep, (r / (p.tp * p.ep)) % p.pp};
}

std::vector<std::optional<Layout>> destination_layouts(const std::string& model_path, const ModelInventory& inventory,
                                                       const RefitConfig& config, const ParallelOptions& p,
                                                       int destinations) {
  std::vector<std::optional<Layout>> out(destinations);
  const bool sharded = config.shard_expert_weights || p.shard_dense;
  const bool parallel = p.tp * p.ep * p.pp > 1;
  if (p.tp < 1 || p.ep < 1 || p.pp < 1)
    throw Error(ErrorKind::kTopology,
                fmt::format("--tp, --ep and --pp must be >= 1, got {}, {}, {}", p.tp, p.ep, p.pp));
  if (!sharded) {
    if (parallel)
      throw Error(ErrorKind::kConfig,
                  fmt::format("--tp/--ep/--pp describe sharded destinations, but nothing is sharded: set "
                              "refit_cfg.nixl.shard_expert_weights=true and/or --shard-dense"));
    return out;
  }
  if (p.tp * p.ep * p.pp != destinations)
    throw Error(ErrorKind::kTopology,
                fmt::format("--tp {} x --ep {} x --pp {} = {} destination ranks, but --destinations is {}", p.tp, p.ep,
                            p.pp, p.tp * p.ep * p.pp, destinations));
  const ModelDims dims = model_dims_from_hf_config(config_json_of(model_path));
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
    validate_layout(*out[r], inventory, fmt::format("destination rank {}", r));
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
