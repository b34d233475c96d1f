// The planner's model of delta refit (prediction.h, predict_delta).
#include <algorithm>
#include <bit>
#include <map>

#include "core/delta_schedule.h"
#include "core/fail.h"
#include "core/host_threads.h"
#include "planner/paired_model.h"
#include "refit/prediction.h"

namespace refit {
namespace {

// A source's comparison of its weights with its base, against one copy of them (copy_rate). On a
// GPU the kernels read the weights and the base twice each: two copies' worth of traffic. On the
// host one core compares, hashes (xxh3) and collects in one pass, two copies' worth, plus about
// 320 bytes' worth of copying per changed element (bench/micro_delta.cpp, 2026-12-06, 64 MiB of
// bf16: 16.7 ms at 0.2% changed, 34.9 ms at 1.7%, against 7.0 ms for its memcpy).
constexpr double kGpuScanCopies = 2.0;
constexpr double kHostScanCopies = 2.0;
constexpr double kHostScanBytesPerChange = 320;
// A destination's patch and hash of its copy: the hash reads it once (half a copy's traffic on a
// GPU); on the host xxh3 costs about a copy and the patch about 150 bytes' worth per change (the
// same bench: 2.2 ms at 0.2%, 10.8 ms at 1.7%, plus 5.6 ms of xxh3).
constexpr double kGpuPatchCopies = 0.5;
constexpr double kHostPatchCopies = 1.0;
constexpr double kHostPatchBytesPerChange = 150;
// The codec's header.
constexpr uint64_t kRecordHeaderBytes = 32;

}  // namespace

uint64_t predicted_record_bytes(const TensorInfo& tensor, double changed_share) {
  const uint64_t bytes = tensor.nbytes();
  const uint64_t elements = tensor.numel();
  if (elements == 0) return bytes;
  const auto changes = static_cast<uint64_t>(std::clamp(changed_share, 0.0, 1.0) * static_cast<double>(elements));
  // Positions: a LEB128 gap per change (changes spread evenly: gaps of 1/share elements), or the
  // bitmap where that is smaller. Values: a zigzagged step of a few units in the last place is one
  // byte (an optimizer step), or the element itself where that is smaller.
  const uint64_t gap = changes == 0 ? 0 : elements / changes;
  const uint64_t gap_bytes = changes * ((std::bit_width(gap | 1) + 6) / 7);
  const uint64_t positions = std::min(gap_bytes, (elements + 7) / 8);
  const uint64_t record = kRecordHeaderBytes + positions + changes * std::min<uint64_t>(1, dtype_size(tensor.dtype));
  return record < bytes ? record : bytes;
}

DeltaPrediction predict_delta(const ModelInventory& model, std::span<const Layout> holds, std::span<const Layout> needs,
                              const Cluster& cluster, double changed_share, const Prediction& full) {
  if (!(changed_share >= 0 && changed_share <= 1))
    fail(ErrorKind::kConfig, "the changed share of a delta refit must lie in [0, 1], got {}", changed_share);
  // Each source compares, and sends as records, what each of its destinations keeps of its
  // tensors: whole tensors, a layout's slices or the plan's pieces, each packed out of its tensor
  // first (PackedBoxes). Per source: bytes compared, bytes packed, changed elements; per
  // destination: bytes patched, changed elements, bytes of records received.
  struct Work {
    uint64_t compared = 0, packed = 0, records = 0;
    double changes = 0;
  };
  std::vector<Work> at_source(holds.empty() ? needs.size() : holds.size()), at_destination(needs.size());
  // Each link's pieces in the order its source streams them, for the replay of its pipeline.
  std::map<std::pair<uint32_t, uint32_t>, std::vector<Work>> links;
  DeltaPrediction p;
  p.transfer = predict_stream(
      model, holds, needs, cluster, [&](uint32_t s, uint32_t d, const TensorInfo& piece, const TensorInfo& yielded) {
        const uint64_t bytes = predicted_record_bytes(piece, changed_share);
        const double changes = changed_share * static_cast<double>(piece.numel());
        Work& source = at_source[s];
        Work& destination = at_destination[d];
        source.compared += piece.nbytes();
        if (piece.nbytes() != yielded.nbytes()) source.packed += piece.nbytes();
        source.changes += changes;
        destination.compared += piece.nbytes();
        destination.changes += changes;
        destination.records += bytes;
        links[{s, d}].push_back(
            {piece.nbytes(), piece.nbytes() != yielded.nbytes() ? piece.nbytes() : 0, bytes, changes});
        return TensorInfo{piece.name, DType::kUInt8, {static_cast<int64_t>(bytes)}};
      });
  for (const Work& d : at_destination) p.wire_bytes = std::max(p.wire_bytes, d.records);
  const NodeGroup& sources = cluster.group(cluster.sources.nodes);
  const NodeGroup& destinations = cluster.group(cluster.destinations.nodes);
  for (const NodeGroup* g : {&sources, &destinations})
    if (g->copy_rate <= 0)
      fail(ErrorKind::kConfig, "node group '{}' has no copy rate: calibrate the cluster (refit plan --calibration)",
           g->name);
  // Each worker's stage, on a worker of its own. On the host it compares or patches on its engine's
  // pool too, which has threads on hosts of 8 cores or more (host_pool_threads): that many cores
  // more, as far as the node's memory gives (a source's tensors that stay valid until send()
  // returns, as registered weights do: those wait for their batch). `spread`: the stage's time on
  // the pool's threads and its caller's; else its work, in seconds of one core.
  auto host_rate = [](const NodeGroup& g, bool spread) {
    const double cores = spread ? host_pool_threads(g.cores) + 1 : 1;
    const double rate = g.copy_rate * cores;
    return g.node_copy_rate > 0 ? std::min(rate, std::max(g.node_copy_rate, g.copy_rate)) : rate;
  };
  auto scan = [&](const Work& w, bool spread = true) {
    const double compared = static_cast<double>(w.compared), packed = static_cast<double>(w.packed);
    if (sources.gpu) return (compared * kGpuScanCopies + packed) / sources.copy_rate;
    return (compared * kHostScanCopies + w.changes * kHostScanBytesPerChange) / host_rate(sources, spread) +
           packed / sources.copy_rate;
  };
  auto patch = [&](const Work& w, bool spread = true) {
    const double patched = static_cast<double>(w.compared);
    if (destinations.gpu) return patched * kGpuPatchCopies / destinations.copy_rate;
    return (patched * kHostPatchCopies + w.changes * kHostPatchBytesPerChange) / host_rate(destinations, spread);
  };
  double cpu_work = 0;  // seconds of one core
  for (const Work& w : at_source) {
    p.scan_seconds = std::max(p.scan_seconds, scan(w));
    cpu_work += scan(w, false);
  }
  for (const Work& w : at_destination) {
    p.patch_seconds = std::max(p.patch_seconds, patch(w));
    cpu_work += patch(w, false);
  }
  // Sources and destinations that are processes of one machine (simulated hosts) compare and patch
  // on its cores all at once.
  if (!sources.gpu && !destinations.gpu && !sources.machine.empty() && sources.machine == destinations.machine &&
      sources.cores > 0)
    p.shared_cores_seconds = cpu_work / sources.cores;
  // Each link as the engine runs it (core/delta_schedule.h): the source compares a batch (one
  // tensor where it compares them as they come) and queues its records; a bucket goes once it
  // holds kBucketBytes of them (the rest with the trailer), once a buffer is free (below); the
  // destination patches each bucket, releases it, and its loader copies the tensors out of its
  // copy. Large tensors at the ends of the stream, or records too few to fill a bucket, leave one
  // side waiting for the other.
  const bool batches = sources.gpu || host_pool_threads(sources.cores) > 0;
  // A bucket the destination loads from the source's buffer (mapped: one node) is acknowledged once
  // released, so the source is two buckets ahead at most; a staged one once read into the
  // destination's own two buffers, so four.
  const bool mapped = cluster.sources.nodes == cluster.destinations.nodes && sources.count == 1 &&
                      cluster.transfer.mapped && cluster.transfer.transport != "nccl";
  const size_t ahead = mapped ? 2 : 4;
  for (const auto& [link, pieces] : links) {
    double source_clock = 0, destination_free = 0;
    std::vector<double> released(ahead, 0);  // of the buckets that went `ahead` before
    size_t bucket = 0;
    Work batch;
    size_t batch_tensors = 0;
    uint64_t queued_records = 0;
    double queued_patch = 0, queued_load = 0;
    // The destination releases a bucket once patched, before its loader copies the tensors out.
    auto send = [&] {
      source_clock = std::max(source_clock, released[bucket % ahead]);
      const double patched = std::max(destination_free, source_clock) + queued_patch;
      released[bucket % ahead] = patched;
      destination_free = patched + queued_load;
      ++bucket;
      queued_records = 0;
      queued_patch = queued_load = 0;
    };
    for (size_t k = 0; k < pieces.size(); ++k) {
      const Work& w = pieces[k];
      batch.compared += w.compared;
      batch.packed += w.packed;
      batch.changes += w.changes;
      ++batch_tensors;
      const bool last = k + 1 == pieces.size();
      if (batches && !last && batch_tensors < delta_schedule::kBatchTensors &&
          batch.compared < delta_schedule::kBatchBytes)
        continue;
      source_clock += scan(batch);
      for (size_t j = k + 1 - batch_tensors; j <= k; ++j) {
        queued_records += pieces[j].records;
        queued_patch += patch(pieces[j]);
        queued_load += static_cast<double>(pieces[j].compared) / destinations.copy_rate;
        if (queued_records >= delta_schedule::kBucketBytes) send();
      }
      batch = {};
      batch_tensors = 0;
    }
    if (queued_records > 0 || bucket == 0) send();  // the trailer's bucket
    p.pipeline_seconds = std::max(p.pipeline_seconds, destination_free);
  }
  // A source or destination with several links works them all; a shared machine's cores and the
  // links themselves bound the refit too.
  p.seconds =
      std::max({p.pipeline_seconds, p.scan_seconds, p.transfer.seconds, p.patch_seconds, p.shared_cores_seconds});
  p.full_seconds = full.seconds;
  p.pays = p.seconds < full.seconds;
  return p;
}

}  // namespace refit
