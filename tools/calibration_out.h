// `refit bench --calibration-out FILE`: what a bench run measured, as a planner calibration
// (cluster.h), merged into FILE. From the run's own timelines: the engine's copy rates (alone,
// together, with more copies than cores), the hand-offs (announcement and acknowledgement
// latency, a destination's turnaround between loads) and the driver's overhead; from
// --baseline: memcpy, ucx_perftest and the cost of a strided row.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace refit::tools {

// `run` is the bench's --json document. Throws Error(kInvalidArgument) when FILE holds the
// engine's rates of another device (one file per kind of run).
void save_bench_calibration(const std::string& path, const nlohmann::json& run);

}  // namespace refit::tools
