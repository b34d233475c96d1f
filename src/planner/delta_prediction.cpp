// The planner's model of delta refit (prediction.h, predict_delta).
#include <algorithm>
#include <bit>

#include "core/fail.h"
#include "planner/paired_model.h"
#include "refit/prediction.h"

namespace refit {
namespace {

// A source's comparison of its weights with its base, against one copy of them (copy_rate). On a
// GPU the two kernels read the weights and the base twice each: two copies' worth of traffic. On
// the host one core compares, hashes (xxh3) and records in one pass: 2.7 GB/s for 0.5% of bf16
// elements changed on the 2-core host where memcpy on one core runs at 16 GB/s (docs/DELTA.md),
// six copies' worth.
constexpr double kGpuScanCopies = 2.0;
constexpr double kHostScanCopies = 6.0;
// A destination's patch and hash of its copy: the hash reads it once (half a copy's traffic on a
// GPU); on the host xxh3 and the patch cost about two copies.
constexpr double kGpuPatchCopies = 0.5;
constexpr double kHostPatchCopies = 2.0;
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

DeltaPrediction predict_delta(const ModelInventory& model, std::span<const Layout> needs, const Cluster& cluster,
                              double changed_share, const Prediction& full) {
  if (!(changed_share >= 0 && changed_share <= 1))
    fail(ErrorKind::kConfig, "the changed share of a delta refit must lie in [0, 1], got {}", changed_share);
  // Each source compares, and sends as records, what its destination keeps: whole tensors, or the
  // slices of a layout (the engine's SelectedSource).
  std::vector<uint64_t> kept(needs.size(), 0), records(needs.size(), 0);
  DeltaPrediction p;
  p.transfer = predict_paired_stream(model, needs, cluster, [&](uint32_t destination, const TensorInfo& piece) {
    const uint64_t bytes = predicted_record_bytes(piece, changed_share);
    kept[destination] += piece.nbytes();
    records[destination] += bytes;
    return TensorInfo{piece.name, DType::kUInt8, {static_cast<int64_t>(bytes)}};
  });
  p.wire_bytes = records.empty() ? 0 : *std::max_element(records.begin(), records.end());
  const uint64_t bytes = kept.empty() ? 0 : *std::max_element(kept.begin(), kept.end());
  auto seconds = [&](const std::string& nodes, double gpu_copies, double host_copies) {
    const NodeGroup& g = cluster.group(nodes);
    if (g.copy_rate <= 0)
      fail(ErrorKind::kConfig, "node group '{}' has no copy rate: calibrate the cluster (refit plan --calibration)",
           g.name);
    return static_cast<double>(bytes) * (g.gpu ? gpu_copies : host_copies) / g.copy_rate;
  };
  // The pairs work side by side: the one that keeps the most sets each stage's time.
  p.scan_seconds = seconds(cluster.sources.nodes, kGpuScanCopies, kHostScanCopies);
  p.patch_seconds = seconds(cluster.destinations.nodes, kGpuPatchCopies, kHostPatchCopies);
  // A pipeline: the source sends a bucket of changes as soon as it holds 1 MiB, and the
  // destination patches each bucket as it arrives, so the slowest of the three stages sets the time.
  p.seconds = std::max({p.scan_seconds, p.transfer.seconds, p.patch_seconds});
  p.full_seconds = full.seconds;
  p.pays = p.seconds < full.seconds;
  return p;
}

}  // namespace refit
