// Timelines: what happened to each bucket of a refit, and when. Engines record these events as
// they move buckets (SendStats/ReceiveStats::events), and the cluster planner (cluster.h) emits the
// same events from its model, so a run and a prediction can be drawn on one chart and compared
// (`python -m refit.timeline`).
//
// Times are seconds on the system clock (since the Unix epoch): processes of one host share it,
// and hosts kept in step by NTP/PTP agree to well under a bucket's time. Consumers subtract the
// refit's start.
#pragma once

#include <chrono>
#include <cstdint>
#include <string_view>
#include <vector>

namespace refit {

enum class TimelinePhase : uint8_t {
  kPack,      // source: copying tensors into the bucket (from its first byte to its announcement)
  kAnnounce,  // source: the bucket is ready (an instant)
  kRead,      // destination: reading the bucket over the transport (none when mapped)
  kLoad,      // destination: handing the bucket's tensors to the loader
  kRelease,   // the bucket's buffer is free again: the source saw it acknowledged, or the
              // destination let go of it (an instant)
  kGather,    // planner, paired path: the training side gathering full tensors first
};

std::string_view to_string(TimelinePhase phase);
// Throws Error(kInvalidArgument) naming the text.
TimelinePhase parse_timeline_phase(std::string_view text);

struct TimelineEvent {
  TimelinePhase phase = TimelinePhase::kPack;
  uint32_t peer = 0;    // the rank on the link's other side
  uint64_t bucket = 0;  // the bucket's number on its link
  double start = 0;     // seconds (see above)
  double end = 0;       // == start for an instant
  uint64_t bytes = 0;
  uint32_t pieces = 0;  // pack, read, load: the tensor pieces in the bucket (each a copy of its own)
};

inline double timeline_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace refit
