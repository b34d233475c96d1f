// `refit chaos`: fault injection. Each trial kills one worker (SIGKILL) at a seeded random point
// of a refit (before connect, while a source packs a bucket, while a destination loads one, or
// between buckets), checks that the refit fails with an error naming the lost peer and the
// phase within the deadline, then replaces the worker and checks that a fresh refit with the
// survivors and the replacement is correct, bitwise.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace refit::tools {

struct ChaosOptions {
  int trials = 100;
  uint64_t seed = 1;
  int sources = 2;
  int destinations = 2;
  double timeout_s = 10;
  std::string json_path;
  std::vector<std::string> overrides;
};

// Returns 0 only when every trial behaved.
int run_chaos(const ChaosOptions& options);

}  // namespace refit::tools
