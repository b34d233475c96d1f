// The machine's own ceilings, measured in the same run as a benchmark: UCX's ucx_perftest
// (one-sided get at the bucket size between two local processes, and small-message latency) and
// memcpy on one core and on all of them; bench can save them as a planner calibration (cluster.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace refit::tools {

struct Baseline {
  std::optional<double> ucp_get_bytes_per_s;  // empty when ucx_perftest is missing or failed
  std::string ucp_get_note;                   // why it is empty, or the command that ran
  std::optional<double> tcp_get_bytes_per_s;  // the same over TCP (UCX_TLS=tcp): this CPU's TCP capacity
  double memcpy_bytes_per_s = 0;
  double all_cores_memcpy_bytes_per_s = 0;  // every core copying at once
  double row_cost_s = 0;                    // each 256-byte row of a strided copy, beyond its bytes
  unsigned cores = 1;
  std::optional<double> message_latency_s;  // one small tagged message, one way (ucx_perftest tag_lat)
};

// Runs both; `tls` restricts UCX transports (empty: UCX's choice).
Baseline measure_baseline(uint64_t bucket_bytes, const std::string& tls);

}  // namespace refit::tools
