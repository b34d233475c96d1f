// The planner's model of a refit's streams, shared by the full and the delta predictions.
#pragma once

#include <cstdint>
#include <functional>
#include <span>

#include "refit/cluster.h"
#include "refit/prediction.h"

namespace refit {

// Seconds of a worker's delta work alone: on its copies (a CPU node's cores and memory, or a GPU),
// then, on a GPU worker, on its process's host threads (each change's record written or read):
// two processes' host work runs side by side while their GPU's copies take turns.
struct DeltaWork {
  double copies = 0, host = 0;
  double seconds() const { return copies + host; }
  DeltaWork& operator+=(const DeltaWork& o) {
    copies += o.copies;
    host += o.host;
    return *this;
  }
  bool any() const { return copies > 0 || host > 0; }
};

// What crosses the link from a source to a destination for a piece of a delta refit, and the
// work at either end around it (SourceDelta, DestinationDelta).
struct Crossed {
  TensorInfo record;        // on the link, from the source's host memory
  DeltaWork compare;        // the source's, before the record goes (its batch's comparison)
  DeltaWork patch;          // the destination's once its bucket is here; it then releases the bucket
  uint64_t load_bytes = 0;  // what the destination's loader then copies out of its copy
};

// What `crossing` makes of `piece` of what source `source`'s weight stream yields of a tensor
// (`yielded`: the tensor, or the source's shard of it) for destination `destination`.
using Crossing =
    std::function<Crossed(uint32_t source, uint32_t destination, const TensorInfo& piece, const TensorInfo& yielded)>;

// predict_refit, with each piece replaced by what `crossing` makes of it and its work run as the
// engine schedules a delta refit (core/delta_schedule.h): paired (no holds), source i streams what
// destination i keeps in one link with the whole bucket; resharding, each source streams the
// plan's pieces on its links. Checks the cluster's ranks.
Prediction predict_stream(const ModelInventory& model, std::span<const Layout> holds, std::span<const Layout> needs,
                          const Cluster& cluster, const Crossing& crossing);

// The rate of a worker's delta work (seconds of it alone are this many bytes of its copies): on a
// GPU its copy rate; on the host its copy rate on the engine's pool threads and its caller's
// (host_pool_threads), as far as the node's memory gives.
double work_rate(const NodeGroup& group);

// The node a calibration measured, as far as its copy rates and cores go: the engine's rates where
// its bench ran on nodes of this kind (engine_device), else memcpy's or the device copy's. What
// apply_calibration gives a node group that leaves them out.
NodeGroup measured_node(const Calibration& calibration, bool gpu);

// Fills what a node group of the calibration's kind leaves out of its delta refit's costs per change
// (compare_change_bytes, patch_change_bytes) from the calibration's measured delta refit: solved at
// the measuring node's work rate (measured_node), with the per-byte costs the model takes as they are.
void fit_delta_costs(NodeGroup& group, const Calibration& calibration);

}  // namespace refit
