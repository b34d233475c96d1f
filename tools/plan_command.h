// `refit plan`: the bucket layout of a model for each destination, without moving bytes.
#pragma once

#include <string>
#include <vector>

#include "parallel_options.h"

namespace refit::tools {

struct PlanOptions {
  std::string model;
  int sources = 1;
  int destinations = 1;
  std::string config_file;
  std::vector<std::string> overrides;
  std::string json_path;
  ParallelOptions parallel;
};

int run_plan(const PlanOptions& options);

}  // namespace refit::tools
