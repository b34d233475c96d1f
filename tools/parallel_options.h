// The destination parallelism the tools simulate (--tp, --ep, --pp, --shard-dense), turned into
// one layout per destination rank. Destination rank r is (pp, ep, tp) = (r / (tp*ep),
// (r / tp) % ep, r % tp): dense tensors are TP-sliced (with --shard-dense), routed experts are
// owned by EP rank and TP-sliced within it (with shard_expert_weights), and each pipeline stage
// drops the layers it does not hold.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "refit/config.h"
#include "refit/layout.h"
#include "refit/model.h"

namespace CLI {
class App;
}

namespace refit::tools {

struct ParallelOptions {
  int tp = 1;
  int ep = 1;
  int pp = 1;
  bool shard_dense = false;
  void add_to(CLI::App& command);
};

// Destination rank r's place in the parallelism: (tp, ep, pp) ranks, as the header says.
struct ParallelRank {
  int tp = 0;
  int ep = 0;
  int pp = 0;
};
ParallelRank parallel_rank(const ParallelOptions& parallel, int destination_rank);

// One entry per destination; all empty when nothing is sharded (every tensor whole).
// Throws Error(kTopology/kConfig) when the flags and the destination count disagree.
std::vector<std::optional<Layout>> destination_layouts(const std::string& model_path, const ModelInventory& inventory,
                                                       const RefitConfig& config, const ParallelOptions& parallel,
                                                       int destinations);

// The training side (--src-tp, --src-pp, --src-dp, --src-ep, --src-etp, or --src-fsdp): what each
// source holds. Unset: every source holds the whole model and feeds its paired destination (the
// reference's topology).
struct SourceParallelOptions {
  int tp = 0, pp = 0, dp = 0, ep = 0, etp = 0;  // 0: not given
  int fsdp = 0;                                 // FSDP2 over this many ranks
  void add_to(CLI::App& command);
  bool given() const { return tp || pp || dp || ep || etp || fsdp; }
};

// Throws Error(kTopology) naming the resharding options when `parallel` is not given (the paired
// topology) and there are fewer sources than destinations.
void check_paired(const SourceParallelOptions& parallel, int sources, int destinations);

// One layout per source rank (Megatron order, layout_builders.h), or none when not given(); an
// absent --src-dp is sources / (tp x pp), as Megatron derives it. Throws Error(kTopology) when the
// flags do not describe `sources` ranks.
std::vector<Layout> source_layouts(const std::string& model_path, const ModelInventory& inventory,
                                   const SourceParallelOptions& parallel, int sources);

// The tensors a destination receives under `layout` (all of them, whole, when empty).
std::vector<TensorInfo> selected_tensors(const ModelInventory& inventory, const std::optional<Layout>& layout);

}  // namespace refit::tools
