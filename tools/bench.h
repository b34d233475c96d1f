// `refit bench`: N source and M destination processes (forked on this host, or ranks started by a
// launcher on several hosts), K refits of a model, every destination tensor checked bitwise
// against its source after every refit.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "parallel_options.h"
#include "refit/model.h"

namespace refit::tools {

struct BenchOptions {
  std::string model;  // config.json, safetensors file or directory; empty: the default model
  int sources = 1;
  int destinations = 1;
  int refits = 3;
  // A delta workload: each refit after the first changes this share of every tensor's elements
  // (0: all new content every refit). Pair with refit_cfg.nixl.delta=true to send only changes.
  double changed = 0;
  bool fp8 = false;  // the sources hold FP8 weights with their block scales (load_model)
  // A folder of consecutive versions of the weights (*.safetensors, in name order): refit k sends
  // version k. Instead of --model.
  std::string versions;
  std::string config_file;
  std::vector<std::string> overrides;
  std::string json_path;
  bool baseline = false;
  std::string calibration_out;  // with baseline: the planner calibration file to write
  std::string kill;             // ROLE:RANK:REFIT:STEP, for failure tests
  // Transfer-buffer device (refit_cfg.nixl.device); cuda also sets backend_name CUDA_IPC. Both
  // apply after the config file and before the command line's overrides. Empty: the config's.
  std::string device;
  // Where source weights and destination parameters live: cpu or cuda; empty: where the
  // transfer buffers are.
  std::string tensors;
  ParallelOptions parallel;
  SourceParallelOptions source_parallel;  // resharding: what each source holds
  // Resharding: also time what the paired topology would need for the same job, in this run:
  // gathering the shards into one full copy per destination, then the paired refit.
  bool compare_paired = false;
  // local: fork every worker on this host; env: this process is one rank of a job started by a
  // launcher (rank_group.h), meeting the others at `rendezvous` (or MASTER_ADDR:MASTER_PORT).
  std::string launcher = "local";
  std::string rendezvous;
  double join_timeout_s = 0;  // how long ranks wait for each other at the rendezvous; 0: the default
};

// The model that --model names: `model`, or the default model when empty. Throws Error(kModel)
// naming the path and what --model accepts when nothing is there.
std::string model_option(const std::string& model);

// The inventory of `path` (load_model_inventory); with `fp8` (--fp8), its FP8 checkpoint form:
// FP8 linear weights with their 128 x 128 block scales (fp8_block_inventory).
ModelInventory load_model(const std::string& path, bool fp8);

// Returns the process exit code: 0 only when every refit succeeded and verified.
int run_bench(const BenchOptions& options);

}  // namespace refit::tools
