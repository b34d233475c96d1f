// The driver side of refit: a WeightSynchronizer runs the reference's lifecycle over any group
// of workers that implements WorkerGroup (forked local processes, Ray actors, MPI ranks...).
//
//   first sync_weights():  memory query -> bucket size (once), create engines (once),
//                          prepare -> metadata -> init_process_groups   ("ready")
//   every sync_weights():  refit; with release_after_refit, shutdown() afterwards
//   shutdown():            finalize every worker; the next sync prepares again with fresh metadata
// A failed refit leaves the synchronizer stale and throws; it never reports success when any
// destination failed.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "refit/bucket_size.h"
#include "refit/checkpoint_engine.h"
#include "refit/config.h"

namespace refit {

// What one worker reports after a refit.
struct WorkerRefitReport {
  bool is_source = false;
  int rank = 0;
  SendStats send;
  ReceiveStats receive;
  std::string detail;  // the worker program's own report (JSON text), e.g. tensor hashes
};

struct RefitReport {
  uint64_t index = 0;
  double seconds = 0;                      // wall time of the whole refit, seen by the driver
  double start_time = 0;                   // when the driver started it, on the timeline clock (timeline.h)
  std::vector<WorkerRefitReport> workers;  // sources first, then destinations, by rank
};

// The workers as the driver sees them. Each call acts on every worker and returns when all
// have answered; a worker that fails makes the call throw Error naming it.
class WorkerGroup {
 public:
  virtual ~WorkerGroup() = default;
  virtual int train_world_size() const = 0;
  virtual int rollout_world_size() const = 0;
  // Total memory of each worker's transfer device, sources first.
  virtual std::vector<uint64_t> total_memory_bytes() = 0;
  virtual void create_engines(uint64_t bucket_bytes, const SessionId& session) = 0;
  // Metadata of every worker, sources first then destinations, each by rank.
  virtual std::vector<Metadata> prepare() = 0;
  virtual void init_process_groups(std::span<const Metadata> metadata) = 0;
  // Runs one refit on every worker at once.
  virtual RefitReport refit(uint64_t index) = 0;
  virtual void finalize() = 0;
};

class WeightSynchronizer {
 public:
  WeightSynchronizer(RefitConfig config, WorkerGroup& workers);

  // One refit; throws Error when any worker failed (the synchronizer then stays stale).
  RefitReport sync_weights();
  void shutdown();

  bool stale() const { return stale_; }
  bool ready() const { return ready_; }
  // Resolved on first use and then fixed, as in the reference.
  const BucketSize& bucket_size();

 private:
  void ensure_ready();

  RefitConfig config_;
  WorkerGroup& workers_;
  std::optional<BucketSize> bucket_size_;
  bool engines_created_ = false;
  bool ready_ = false;
  bool stale_ = true;
  uint64_t refits_ = 0;
};

}  // namespace refit
