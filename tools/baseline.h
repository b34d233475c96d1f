// The machine's own ceilings, measured in the same run as a benchmark: UCX's ucx_perftest
// (one-sided get at the bucket size, between two local processes) and single-thread memcpy.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace refit::tools {

struct Baseline {
  std::optional<double> ucp_get_bytes_per_s;  // empty when ucx_perftest is missing or failed
  std::string ucp_get_note;                   // why it is empty, or the command that ran
  double memcpy_bytes_per_s = 0;
};

// Runs both; `tls` restricts UCX transports (empty: UCX's choice).
Baseline measure_baseline(uint64_t bucket_bytes, const std::string& tls);

}  // namespace refit::tools
