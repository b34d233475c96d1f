// The worker programs of `refit bench`: sources that stream a model's tensors (synthetic
// content that changes every refit, or the bytes of safetensors files) and destinations that
// hash what they receive, so the driver can check every tensor bitwise against its source.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "refit/local_group.h"
#include "refit/layout.h"
#include "refit/model.h"

namespace refit::tools {

// Kill a worker on purpose, for failure tests: the worker SIGKILLs itself when it reaches
// `step` in refit `refit` (a source: before yielding tensor `step`; a destination: before
// loading batch `step`).
struct KillPoint {
  bool source = true;
  int rank = 0;
  uint64_t refit = 0;
  uint64_t step = 0;
};
// "source:0:1:25" = role:rank:refit:step. Throws Error(kInvalidArgument).
KillPoint parse_kill_point(const std::string& text);

struct BenchModel {
  ModelInventory inventory;
  std::string safetensors_path;  // empty: synthetic content
};

// `layouts[r]` is destination r's layout: source r hashes what that destination should get.
WorkerProgramFactory bench_programs(const BenchModel& model, const std::vector<std::optional<Layout>>& layouts,
                                    std::optional<KillPoint> kill);

}  // namespace refit::tools
