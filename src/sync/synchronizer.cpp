#include "refit/synchronizer.h"

#include <spdlog/spdlog.h>

namespace refit {

WeightSynchronizer::WeightSynchronizer(RefitConfig config, WorkerGroup& workers)
    : config_(std::move(config)), workers_(workers) {}

const BucketSize& WeightSynchronizer::bucket_size() {
  if (!bucket_size_) {
    bucket_size_ = resolve_bucket_size(config_, workers_.total_memory_bytes());
    spdlog::info("{}", bucket_size_line(*bucket_size_, config_.device));
  }
  return *bucket_size_;
}

void WeightSynchronizer::ensure_ready() {
  if (ready_) return;
  if (!engines_created_) {
    const uint64_t bytes = bucket_size().bytes;
    workers_.create_engines(bytes, new_session_id());
    engines_created_ = true;
    spdlog::info("Using checkpoint-engine refit backend: {}", config_.refit_transport);
  }
  auto metadata = workers_.prepare();
  workers_.init_process_groups(metadata);
  ready_ = true;
}

RefitReport WeightSynchronizer::sync_weights() {
  stale_ = true;
  struct ReleaseAfterRefit {
    WeightSynchronizer& self;
    ~ReleaseAfterRefit() {
      if (!self.config_.release_after_refit) return;
      try {
        self.shutdown();
      } catch (const std::exception& e) {
        // The refit's own error (if any) is the one to report.
        spdlog::warn("release after refit failed: {}", e.what());
      }
    }
  } release{*this};
  ensure_ready();
  RefitReport report = workers_.refit(refits_++);
  stale_ = false;
  return report;
}

void WeightSynchronizer::shutdown() {
  if (!ready_) return;
  ready_ = false;
  workers_.finalize();
}

}  // namespace refit
