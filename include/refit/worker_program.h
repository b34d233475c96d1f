// What a worker process of a refit group does with its engine: which weights a source sends,
// how a destination loads what it receives. Process groups (local_group.h, rank_group.h) create
// the program inside each worker process, from the same GroupOptions on every host.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "refit/checkpoint_engine.h"
#include "refit/config.h"
#include "refit/layout.h"

namespace refit {

class WorkerProgram {
 public:
  virtual ~WorkerProgram() = default;
  // On a source whose group reads in place (direct_reads), each time its engine is created: the
  // program may move its weights into engine.allocate_weight_memory(), which destinations on its
  // host map whatever the transport (UCX cannot map other memory), so that they read every tensor
  // in place. Memory of an earlier engine is still valid during the call, and freed after it.
  virtual void place_weights(CheckpointEngine& engine) {}
  // Before refit `index` starts (not timed): a source makes its weights ready, a destination
  // sets itself up for the loads.
  virtual void stage(uint64_t index) {}
  // The weights a source sends in refit `index`.
  virtual std::unique_ptr<WeightSource> weights(uint64_t index) = 0;
  // The loader a destination uses in refit `index`.
  virtual BatchLoader loader(uint64_t index) = 0;
  // After refit `index`: a report for the driver (JSON text), e.g. per-tensor hashes.
  virtual std::string report(uint64_t index) { return "{}"; }
};

using WorkerProgramFactory = std::function<std::unique_ptr<WorkerProgram>(bool is_source, int rank)>;

// A group of sources and destinations: what every worker needs to know.
struct GroupOptions {
  RefitConfig config;
  int sources = 1;
  int destinations = 1;
  uint64_t model_fingerprint = 0;
  WorkerProgramFactory program;
  // Destination r's layout (layout.h); missing or empty entries mean every tensor whole.
  std::vector<std::optional<Layout>> destination_layouts;
  // Resharding: source s's holdings (EngineOptions::holds) and the model's inventory. Empty:
  // every source holds the whole model (the paired topology).
  std::vector<Layout> source_layouts;
  std::shared_ptr<const ModelInventory> model;
};

}  // namespace refit
