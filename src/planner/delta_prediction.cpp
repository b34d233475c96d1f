// The planner's model of delta refit (prediction.h, predict_delta).
#include <algorithm>
#include <bit>

#include "core/fail.h"
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

// Built-in, or as the group's calibration measured them.
double compare_change_bytes(const NodeGroup& g) {
  return g.compare_change_bytes >= 0 ? g.compare_change_bytes : kHostScanBytesPerChange;
}
double patch_change_bytes(const NodeGroup& g) {
  return g.patch_change_bytes >= 0 ? g.patch_change_bytes : kHostPatchBytesPerChange;
}

}  // namespace

void fit_host_delta_costs(NodeGroup& group, const Calibration& cal) {
  if (cal.delta_changes <= 0 || cal.delta_bytes <= 0 || cal.delta_compare_s < 0 || cal.delta_patch_s < 0) return;
  // The machine that measured, as apply_calibration makes a CPU node of it.
  NodeGroup measured;
  measured.copy_rate = cal.engine_copy_rate > 0 ? cal.engine_copy_rate : cal.host_copy_rate;
  measured.node_copy_rate = cal.engine_node_copy_rate > 0 ? cal.engine_node_copy_rate : cal.host_node_copy_rate;
  measured.cores = cal.cores;
  const double rate = work_rate(measured);
  if (rate <= 0) return;
  auto per_change = [&](double seconds, double copies) {
    return std::max(0.0, (seconds * rate - copies * cal.delta_bytes) / cal.delta_changes);
  };
  if (group.compare_change_bytes < 0) group.compare_change_bytes = per_change(cal.delta_compare_s, kHostScanCopies);
  if (group.patch_change_bytes < 0) group.patch_change_bytes = per_change(cal.delta_patch_s, kHostPatchCopies);
}

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
  const NodeGroup& sources = cluster.group(cluster.sources.nodes);
  const NodeGroup& destinations = cluster.group(cluster.destinations.nodes);
  for (const NodeGroup* g : {&sources, &destinations})
    if (g->copy_rate <= 0)
      fail(ErrorKind::kConfig, "node group '{}' has no copy rate: calibrate the cluster (refit plan --calibration)",
           g->name);
  // Each source compares, and sends as records, what each of its destinations keeps of its
  // tensors: whole tensors, a layout's slices or the plan's pieces, each packed out of its tensor
  // first where it is not what the stream yields (a copy, on one core). The pipeline model runs
  // each piece's comparing, record and patching as the engine schedules them; here, each worker's
  // totals and the records the busiest destination receives.
  std::vector<double> compared(holds.empty() ? needs.size() : holds.size()), patched(needs.size());
  std::vector<uint64_t> records(needs.size());
  DeltaPrediction p;
  p.transfer = predict_stream(
      model, holds, needs, cluster, [&](uint32_t s, uint32_t d, const TensorInfo& piece, const TensorInfo& yielded) {
        const auto bytes = static_cast<double>(piece.nbytes());
        const double packed = piece.nbytes() != yielded.nbytes() ? bytes : 0;
        const double changes = changed_share * static_cast<double>(piece.numel());
        Crossed c;
        c.record = {piece.name, DType::kUInt8, {static_cast<int64_t>(predicted_record_bytes(piece, changed_share))}};
        c.compare_seconds =
            sources.gpu ? (bytes * kGpuScanCopies + packed) / sources.copy_rate
                        : (bytes * kHostScanCopies + changes * compare_change_bytes(sources)) / work_rate(sources) +
                              packed / sources.copy_rate;
        c.patch_seconds = destinations.gpu ? bytes * kGpuPatchCopies / destinations.copy_rate
                                           : (bytes * kHostPatchCopies + changes * patch_change_bytes(destinations)) /
                                                 work_rate(destinations);
        c.load_bytes = piece.nbytes();
        compared[s] += c.compare_seconds;
        patched[d] += c.patch_seconds;
        records[d] += c.record.nbytes();
        return c;
      });
  p.scan_seconds = *std::max_element(compared.begin(), compared.end());
  p.patch_seconds = *std::max_element(patched.begin(), patched.end());
  p.wire_bytes = *std::max_element(records.begin(), records.end());
  p.seconds = p.transfer.seconds;
  p.full_seconds = full.seconds;
  p.pays = p.seconds < full.seconds;
  return p;
}

}  // namespace refit
