// The one JSON form of timeline events (timeline.h), written by `refit bench --json` per refit and
// by `refit plan --json` per prediction, read by python/refit/timeline.py and the calibration:
// {"worker": "source 0", "phase": "pack", "peer": 1, "bucket": 3, "start": s, "end": s, "bytes": n,
// "pieces": tensor pieces in the bucket}.
#pragma once

#include <nlohmann/json.hpp>
#include <span>
#include <string>

#include "refit/timeline.h"

namespace refit::tools {

// Appends `worker`'s events to the array `out`, with times in seconds since `origin`.
inline void append_timeline(nlohmann::json& out, const std::string& worker, std::span<const TimelineEvent> events,
                            double origin = 0) {
  for (const TimelineEvent& e : events)
    out.push_back({{"worker", worker},
                   {"phase", to_string(e.phase)},
                   {"peer", e.peer},
                   {"bucket", e.bucket},
                   {"start", e.start - origin},
                   {"end", e.end - origin},
                   {"bytes", e.bytes},
                   {"pieces", e.pieces}});
}

}  // namespace refit::tools
