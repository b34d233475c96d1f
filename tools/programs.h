// The worker programs of `refit bench`: sources that stream a model's tensors (synthetic
// content that changes every refit, or the bytes of safetensors files) and destinations that
// load what they receive and hash it, so the driver can check every tensor bitwise against its
// source. With GPU tensors, a destination copies each received tensor into its own GPU
// parameter (the load a real inference engine does) and hashes the parameters after the refit.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "refit/layout.h"
#include "refit/local_group.h"
#include "refit/model.h"

namespace refit::tools {

// Kill a worker on purpose, for failure tests: the worker SIGKILLs itself when it reaches
// `step` in refit `refit`. A source dies before yielding tensor `step` (mid-bucket, while
// packing); a destination dies halfway through loading batch `step` ("load") or right after
// loading it, before the next bucket is read ("after").
struct KillPoint {
  enum class When { kPack, kLoad, kAfterLoad };
  bool source = true;
  int rank = 0;
  uint64_t refit = 0;
  uint64_t step = 0;
  When when = When::kPack;
};
// "source:0:1:25", "destination:1:2:3:load", "destination:0:1:2:after" =
// role:rank:refit:step[:when]. Throws Error(kInvalidArgument).
KillPoint parse_kill_point(const std::string& text);

struct BenchModel {
  ModelInventory inventory;
  std::string safetensors_path;  // empty: synthetic content
  // Where the sources' weights and the destinations' parameters live: host memory (hashed with
  // xxh3 on the CPU) or the worker's current GPU (filled and hashed by GPU kernels).
  MemoryKind tensors = MemoryKind::kHost;
  // A delta workload (synthetic host content, paired): each refit after the first moves this
  // share of every tensor's elements by one or two units in the last place, as an optimizer step
  // does, at positions drawn from the refit; 0: all new content every refit.
  double changed_share = 0;
  // How many of a tensor's `elements` a refit of the delta workload moves.
  static uint64_t changed_elements(uint64_t elements, double share) {
    return static_cast<uint64_t>(share * static_cast<double>(elements));
  }
  // Consecutive versions of the weights (safetensors files, e.g. python/bench/delta_workload.py
  // --save-dir): refit k sends version k; safetensors_path is the first.
  std::vector<std::string> versions;
};

// `layouts[r]` is destination r's layout: source r hashes what that destination should get.
// With `holds` (resharding), source s holds only holds[s] of each tensor, and each destination
// checks itself: the content is a function of the refit, the tensor and the byte's place in the
// whole tensor, so a destination computes what its slices must hold (after the refit, untimed).
WorkerProgramFactory bench_programs(const BenchModel& model, const std::vector<std::optional<Layout>>& layouts,
                                    const std::vector<Layout>& holds, std::optional<KillPoint> kill);

}  // namespace refit::tools
