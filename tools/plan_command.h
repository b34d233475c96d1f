// `refit plan`: the bucket layout of a model for each destination, without moving bytes; with
// --cluster, a prediction of one refit on that cluster (cluster_plan.h).
#pragma once

#include <string>
#include <vector>

#include "parallel_options.h"

namespace refit::tools {

struct PlanOptions {
  std::string model;
  bool fp8 = false;  // the model in its FP8 checkpoint form (load_model)
  int sources = 1;
  int destinations = 1;
  std::string config_file;
  std::vector<std::string> overrides;
  std::string json_path;
  // Total memory of each worker's transfer device on the target cluster ("80GiB"); empty: this
  // host's memory.
  std::string target_memory;
  ParallelOptions parallel;
  SourceParallelOptions source_parallel;
  // A cluster description (cluster.h): predict one refit there instead, refit's path and the
  // paired path; calibration files fill in the rates it leaves out.
  std::string cluster;
  std::vector<std::string> calibrations;
  // With --cluster: also predict a delta refit (refit_cfg.nixl.delta) when this share of every
  // tensor's elements changed since the last refit; < 0: none.
  double changed = -1;
};

int run_plan(const PlanOptions& options);

}  // namespace refit::tools
