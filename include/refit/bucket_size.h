// Bucket sizing: each worker reports its total memory; the driver takes the minimum times the
// ratio, floors it to whole MiB, and rejects less than 1 MiB. The size is then fixed for the
// lifetime of the driver, as in the reference.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "refit/config.h"

namespace refit {

struct BucketSize {
  uint64_t bytes = 0;
  uint64_t min_total_memory = 0;  // 0 when bucket_bytes was given explicitly
  double ratio = 0;               // 0 when bucket_bytes was given explicitly
  uint64_t uncapped_bytes = 0;    // what the ratio gave, when the model's size capped it (else 0)
  bool operator==(const BucketSize&) const = default;
};

// `worker_total_memory` holds one entry per worker. Uses config.bucket_bytes when set (any size
// >= 1 byte). Otherwise, when `model_bytes` (the most one source sends in a refit) is given, a
// bucket is no larger than that, rounded up to whole MiB: a larger buffer never fills, and costs
// memory and set-up time. Throws Error(kConfig) for an empty list (even with bucket_bytes set), a
// ratio outside (0, 0.5), or a result below 1 MiB.
BucketSize resolve_bucket_size(const RefitConfig& config, std::span<const uint64_t> worker_total_memory,
                               uint64_t model_bytes = 0);

// The reference's log line:
// "[checkpoint engine] Bucket size: 4096 MiB per buffer (5.0% of 80.00 GiB minimum total GPU memory)."
// (says "host memory" for device cpu; an explicit bucket_bytes is reported as such).
std::string bucket_size_line(const BucketSize& size, const Device& device);

}  // namespace refit
