#include "refit/synchronizer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <chrono>

#include "core/fail.h"
#include "refit/timeline.h"

namespace refit {

WeightSynchronizer::WeightSynchronizer(RefitConfig config, WorkerGroup& workers, std::string backend)
    : config_(std::move(config)), workers_(workers), backend_(std::move(backend)) {}

const BucketSize& WeightSynchronizer::bucket_size() {
  if (!bucket_size_) {
    bucket_size_ = resolve_bucket_size(config_, workers_.total_memory_bytes(), model_bytes_);
    spdlog::info("{}", bucket_size_line(*bucket_size_, config_.device));
  }
  return *bucket_size_;
}

void WeightSynchronizer::ensure_ready() {
  if (ready_) return;
  if (!engines_created_) {
    const uint64_t bytes = bucket_size().bytes;
    if (!session_) session_ = new_session_id();
    // Again after a failed refit, with the same session and bucket size: workers that have an
    // engine keep it, and one put in place of a lost worker gets its engine.
    workers_.create_engines(bytes, *session_);
    engines_created_ = true;
    if (!backend_logged_) {
      spdlog::info("Using checkpoint-engine refit backend: {}", config_.refit_transport);
      backend_logged_ = true;
    }
  }
  auto metadata = workers_.prepare();
  const int train = workers_.train_world_size(), rollout = workers_.rollout_world_size();
  if (metadata.size() != static_cast<size_t>(train) + static_cast<size_t>(rollout))
    fail(ErrorKind::kTopology,
         "the worker group returned {} metadata entries for train_world_size={} + rollout_world_size={}",
         metadata.size(), train, rollout);
  workers_.init_process_groups(metadata);
  ready_ = true;
}

RefitReport WeightSynchronizer::refit_once() {
  const uint64_t index = refits_++;
  const auto start = std::chrono::steady_clock::now();
  const double start_time = timeline_now();
  RefitReport report = workers_.refit(index);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  report.index = index;
  // A group that prepares its workers' weights inside refit() (untimed) reports the transfer's
  // own wall time; otherwise the driver's is the refit's.
  if (report.seconds <= 0) report.seconds = seconds;
  if (report.start_time <= 0) report.start_time = start_time;
  std::vector<std::string> failed;
  for (const auto& w : report.workers)
    if (w.failed) failed.push_back(fmt::format("{} rank {}", w.is_source ? "source" : "destination", w.rank));
  if (!failed.empty())
    fail(ErrorKind::kTransport,
         "Weight transfer failed during {} checkpoint-engine sync: {} reported failure in refit {}", backend_,
         fmt::join(failed, ", "), index);
  return report;
}

RefitReport WeightSynchronizer::sync_weights() {
  stale_ = true;
  RefitReport report;
  try {
    ensure_ready();
    report = refit_once();
  } catch (...) {
    // A worker may be replaced before the next sync (a lost host): give every worker an engine
    // again then. And exchange fresh metadata (beyond the reference, which keeps the broken
    // connections): shut down now, whatever release_after_refit says.
    engines_created_ = false;
    release("shutdown after a failed refit");
    throw;
  }
  stale_ = false;
  if (config_.release_after_refit) release("release after refit");
  return report;
}

void WeightSynchronizer::release(const char* what) noexcept {
  // The refit's own error (if any) is the one to report.
  try {
    shutdown();
  } catch (const std::exception& e) {
    spdlog::warn("{} failed: {}", what, e.what());
  } catch (...) {
    spdlog::warn("{} failed", what);
  }
}

void WeightSynchronizer::shutdown() {
  if (!ready_) return;
  ready_ = false;
  workers_.finalize();
}

}  // namespace refit
