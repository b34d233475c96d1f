// The planner's model of delta refit (prediction.h, predict_delta).
#include <algorithm>
#include <bit>

#include "core/fail.h"
#include "planner/paired_model.h"
#include "refit/prediction.h"

namespace refit {
namespace {

// A worker's delta work, in copies' worth of its bytes at its work rate plus bytes' worth per changed
// element, comparing at a source and patching at a destination; and on a GPU, the source's waits
// for its kernels (on its host threads, its GPU free meanwhile), in copies' worth of its bytes.
struct DeltaCosts {
  double scan_copies, scan_bytes_per_change, patch_copies, patch_bytes_per_change, scan_wait_copies;
};
// On the host one core compares, hashes (xxh3) and collects in one pass, two copies' worth, plus
// about 320 bytes' worth of copying per changed element (bench/micro_delta.cpp, 2026-12-06, 64 MiB
// of bf16: 16.7 ms at 0.2% changed, 34.9 ms at 1.7%, against 7.0 ms for its memcpy); a
// destination's xxh3 of its copy costs about a copy, the patch about 150 bytes' worth per change
// (2.2 ms at 0.2%, 10.8 ms at 1.7%, plus 5.6 ms of xxh3).
constexpr DeltaCosts kHostDelta{2.0, 320, 1.0, 150, 0};
// On a GPU the kernels read the weights and the base twice each (two copies' worth of traffic) and
// the hash reads the patched copy once (half a copy's); but each changed element crosses to the
// host, where the record is written (and at the destination read, then copied back): in bytes' worth
// of the GPU's copies that is far more per change than on the host. And per batch (64 MiB) a source
// launches its kernels and waits for them twice, its changes copied out between: about 8 copies'
// worth of its bytes. One H100, 2026-12-07, Qwen3-8B, comparing 0.559 s at 1% changed (82 M
// changes) and 0.160-0.163 s at 0.1% with the engine's copies at 1,409 GB/s: 0.117 s that does not
// shrink with the changes, 0.023 s of it the kernels' traffic; per change 5.4 ns comparing and
// 5.0 ns patching (0.426 s at 1%, 0.055-0.062 s at 0.1%). Refitted after the destination decoded a
// batch's records together (another H100, 2026-12-07 evening, `scripts/calibrate.sh --gpu`, the
// engine's copies at 1,392 GB/s): comparing 0.517 s and patching 0.395 s at 1%, about 6,800 and
// 6,600 bytes' worth a change beyond the copies and waits above.
constexpr DeltaCosts kGpuDelta{2.0, 6800, 0.5, 6600, 8.0};
const DeltaCosts& built_in(const NodeGroup& g) { return g.gpu ? kGpuDelta : kHostDelta; }

// Built-in, or as the group's calibration measured them.
double compare_change_bytes(const NodeGroup& g) {
  return g.compare_change_bytes >= 0 ? g.compare_change_bytes : built_in(g).scan_bytes_per_change;
}
double patch_change_bytes(const NodeGroup& g) {
  return g.patch_change_bytes >= 0 ? g.patch_change_bytes : built_in(g).patch_bytes_per_change;
}
// Work of `copies` copies' worth on a group's copies and `host` bytes' worth of its work rate on a
// GPU worker's host threads (a CPU node's all on its copies).
DeltaWork work_of(const NodeGroup& g, double copies, double host) {
  const double rate = work_rate(g);
  if (g.gpu) return {copies / rate, host / rate};
  return {(copies + host) / rate, 0};
}
// The codec's header.
constexpr uint64_t kRecordHeaderBytes = 32;

}  // namespace

void fit_delta_costs(NodeGroup& group, const Calibration& cal) {
  if (cal.delta_changes <= 0 || cal.delta_bytes <= 0 || cal.delta_compare_s < 0 || cal.delta_patch_s < 0) return;
  const double rate = work_rate(measured_node(cal, group.gpu));
  if (rate <= 0) return;
  auto per_change = [&](double seconds, double copies) {
    return std::max(0.0, (seconds * rate - copies * cal.delta_bytes) / cal.delta_changes);
  };
  if (group.compare_change_bytes < 0)
    group.compare_change_bytes =
        per_change(cal.delta_compare_s, built_in(group).scan_copies + built_in(group).scan_wait_copies);
  if (group.patch_change_bytes < 0)
    group.patch_change_bytes = per_change(cal.delta_patch_s, built_in(group).patch_copies);
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
        c.compare = work_of(sources, bytes * built_in(sources).scan_copies,
                            bytes * built_in(sources).scan_wait_copies + changes * compare_change_bytes(sources));
        c.compare.copies += packed / sources.copy_rate;
        c.patch = work_of(destinations, bytes * built_in(destinations).patch_copies,
                          changes * patch_change_bytes(destinations));
        c.load_bytes = piece.nbytes();
        compared[s] += c.compare.seconds();
        patched[d] += c.patch.seconds();
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
