#include "refit/bucket_size.h"

#include <algorithm>

#include "core/fail.h"

namespace refit {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr double kGiB = double(uint64_t{1} << 30);

}  // namespace

BucketSize resolve_bucket_size(const RefitConfig& config, std::span<const uint64_t> worker_total_memory,
                               uint64_t model_bytes) {
  if (worker_total_memory.empty()) {
    fail(ErrorKind::kConfig, "bucket sizing needs the total memory of at least one worker, got none");
  }
  if (config.bucket_bytes) {
    if (*config.bucket_bytes == 0) fail(ErrorKind::kConfig, "refit_cfg.nixl.bucket_bytes must be >= 1 byte, got 0");
    return {*config.bucket_bytes, 0, 0};
  }
  // Checked again here because a RefitConfig may be built in code, not only by parse_config.
  const double ratio = config.update_weights_bucket_memory_ratio;
  if (config.uses_plugin()) {
    if (!(ratio > 0 && ratio < 1))
      fail(ErrorKind::kConfig, "refit_cfg['{}'].update_weights_bucket_memory_ratio must be > 0 and < 1, got {}",
           config.refit_transport, ratio);
  } else if (!(ratio > 0 && 2 * ratio < 1)) {
    fail(ErrorKind::kConfig, "refit_cfg.nixl.update_weights_bucket_memory_ratio must be > 0 and < 0.5, got {}", ratio);
  }
  const uint64_t min_total = *std::min_element(worker_total_memory.begin(), worker_total_memory.end());
  // As the reference: int(min * r) in double precision, then floored to whole MiB.
  const auto raw = static_cast<uint64_t>(static_cast<double>(min_total) * ratio);
  const uint64_t bytes = raw / kMiB * kMiB;
  if (bytes < kMiB) {
    fail(ErrorKind::kConfig,
         "Checkpoint-engine bucket sizing produced less than 1 MiB per buffer: ratio {} of {} bytes ({:.2f} GiB) "
         "minimum total memory over {} workers is {} bytes; raise refit_cfg.nixl.update_weights_bucket_memory_ratio "
         "or set refit_cfg.nixl.bucket_bytes",
         ratio, min_total, static_cast<double>(min_total) / kGiB, worker_total_memory.size(), raw);
  }
  const uint64_t model_mib = (model_bytes + kMiB - 1) / kMiB * kMiB;
  if (model_bytes > 0 && model_mib < bytes) return {model_mib, min_total, ratio, bytes};
  return {bytes, min_total, ratio};
}

std::string bucket_size_line(const BucketSize& size, const Device& device) {
  if (size.min_total_memory == 0) {
    return size.bytes % kMiB == 0
               ? fmt::format("[checkpoint engine] Bucket size: {} MiB per buffer (set by refit_cfg.nixl.bucket_bytes).",
                             size.bytes / kMiB)
               : fmt::format(
                     "[checkpoint engine] Bucket size: {} bytes per buffer (set by refit_cfg.nixl.bucket_bytes).",
                     size.bytes);
  }
  // Python's {:.1%} is the value times 100 in fixed notation with one decimal.
  if (size.uncapped_bytes > 0)
    return fmt::format(
        "[checkpoint engine] Bucket size: {} MiB per buffer (the model's size; {:.1f}% of {:.2f} GiB minimum total {} "
        "memory would be {} MiB).",
        size.bytes / kMiB, size.ratio * 100, static_cast<double>(size.min_total_memory) / kGiB,
        device.kind == Device::Kind::kCpu ? "host" : "GPU", size.uncapped_bytes / kMiB);
  return fmt::format(
      "[checkpoint engine] Bucket size: {} MiB per buffer ({:.1f}% of {:.2f} GiB minimum total {} memory).",
      size.bytes / kMiB, size.ratio * 100, static_cast<double>(size.min_total_memory) / kGiB,
      device.kind == Device::Kind::kCpu ? "host" : "GPU");
}

}  // namespace refit
