// `refit bench`: N source and M destination processes on this host, K refits of a model,
// every destination tensor checked bitwise against its source after every refit.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "parallel_options.h"

namespace refit::tools {

struct BenchOptions {
  std::string model;  // config.json, safetensors file or directory; empty: the default model
  int sources = 1;
  int destinations = 1;
  int refits = 3;
  std::string config_file;
  std::vector<std::string> overrides;
  std::string json_path;
  bool baseline = false;
  std::string kill;  // ROLE:RANK:REFIT:STEP, for failure tests
  // Transfer-buffer device (refit_cfg.nixl.device); cuda also sets backend_name CUDA_IPC. Both
  // apply after the config file and before the command line's overrides. Empty: the config's.
  std::string device;
  // Where source weights and destination parameters live: cpu or cuda; empty: where the
  // transfer buffers are.
  std::string tensors;
  ParallelOptions parallel;
};

// Returns the process exit code: 0 only when every refit succeeded and verified.
int run_bench(const BenchOptions& options);

std::string default_model_path();

}  // namespace refit::tools
