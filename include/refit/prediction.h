// The cluster planner's model of one refit: what refit's engines would do on a cluster (cluster.h),
// bucket by bucket, and how long it would take. It replays the engine's pipeline on a model of
// the links and copies:
//  - buckets: each link's pieces (transfer_plan.h), packed as the engine packs them (plan.h), in
//    buffers of the engine's link size; a source packs its links in the order of its weight
//    stream, one copy at a time;
//  - the pipeline: two buffers per link; a source refills a buffer once the destination is done
//    with it; a destination reads (staged) or loads straight from the source's mapped buffer;
//    its loads run one at a time; announcements and acknowledgements each cost one message
//    latency;
//  - reads in place (transfer.direct_reads): on a mapped link whose transport maps the source's
//    own tensors, contiguous pieces are not packed: the source announces groups of them (each at
//    most the link's bucket bytes, besides what the bucket packs) and the destination's load
//    copies them straight from the source's memory; strided and empty pieces keep their buckets;
//  - the rates: every copy and read is a flow through the resources it uses (a GPU's copy
//    engine, a CPU node's memory, NIC rails each way, NVLink each way), which share their
//    capacity equally between the flows crossing them, each flow also capped by its own rate.
// The paired path (the reference's topology) is modelled too: the training side first gathers the
// full tensors each paired source streams (each node receives them once over all its rails,
// then NVLink or memory hands them to its ranks), then source i feeds destination i.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "refit/cluster.h"
#include "refit/layout.h"
#include "refit/model.h"
#include "refit/timeline.h"

namespace refit {

struct PredictedWorker {
  std::string worker;                 // "source 3", "destination 0"
  double seconds = 0;                 // from the refit's start until this worker is done
  uint64_t bytes = 0;                 // sent (sources) or received (destinations)
  std::vector<TimelineEvent> events;  // times in seconds since the refit's start
};

// A resource's demand: the bytes that cross it over its capacity, the least time it needs.
struct ResourceDemand {
  std::string name;  // "destination 3 NIC in (node rollout/0)"
  double seconds = 0;
  uint64_t bytes = 0;
  double capacity = 0;  // bytes per second
};

struct Prediction {
  double seconds = 0;         // one refit, from the driver's start to its end
  double gather_seconds = 0;  // paired path: the training side's gather, before the transfer
  double overhead_seconds = 0;
  std::string bound;          // what decides the time, in words
  uint64_t bucket_bytes = 0;  // per link buffer (the largest)
  uint64_t buckets = 0;
  uint64_t in_place_bytes = 0;  // of the bytes the destinations receive, loaded in place (direct_reads)
  std::vector<PredictedWorker> sources, destinations;
  std::vector<ResourceDemand> demands;  // the busiest first
};

// refit's path. `holds`: what each source holds (empty: every source holds the whole model and
// feeds its paired destination); `needs`: one layout per destination (an empty Layout: the whole
// model). The cluster's bucket size must be set, and its rates (apply_calibration). Throws
// Error(kConfig) when the layouts and the cluster's ranks disagree.
Prediction predict_refit(const ModelInventory& model, std::span<const Layout> holds, std::span<const Layout> needs,
                         const Cluster& cluster);

// The reference's paired path for the same layouts: gather, then source i -> destination i.
Prediction predict_paired(const ModelInventory& model, std::span<const Layout> holds, std::span<const Layout> needs,
                          const Cluster& cluster);

// Delta refit (refit_cfg.nixl.delta) of the refit `full` (paired without `holds`, resharding with
// them) predicts, when `changed_share` of every tensor's elements changed since the last refit by
// steps of a few units in the last place (an optimizer's): each tensor, each slice a destination's
// layout keeps, or each piece of the transfer plan crosses as the record the codec would write
// (predicted_record_bytes) through refit's pipeline as modelled above, scheduled as the engine
// schedules a delta refit (core/delta_schedule.h): each source compares its pieces (copying out the
// slices or pieces first) in batches before their records go, a bucket goes once it holds a few
// records, and each destination patches and hashes its copy from a bucket, releases it, then loads
// its pieces; that work runs at multiples of the node group's copy rate through the same copy
// resources (one machine's cores are shared by its processes). Throws Error(kConfig) for a share
// outside [0, 1].
struct DeltaPrediction {
  double seconds = 0;        // one delta refit
  double full_seconds = 0;   // the full refit it replaces
  double scan_seconds = 0;   // the busiest source's comparing, alone
  double patch_seconds = 0;  // the busiest destination's patching and hashing, alone
  uint64_t wire_bytes = 0;   // every record (or whole tensor) the busiest destination receives
  bool pays = false;         // faster than the full refit
  Prediction transfer;       // the delta refit through the pipeline (seconds, timeline, demands)
};
DeltaPrediction predict_delta(const ModelInventory& model, std::span<const Layout> holds, std::span<const Layout> needs,
                              const Cluster& cluster, double changed_share, const Prediction& full);

// The bytes a tensor's delta record takes at `changed_share`, or the tensor's own bytes where the
// record would not be smaller (it then goes whole).
uint64_t predicted_record_bytes(const TensorInfo& tensor, double changed_share);

}  // namespace refit
