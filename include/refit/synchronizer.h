// The driver side of refit: a WeightSynchronizer runs the reference's lifecycle over any group
// of workers that implements WorkerGroup (forked local processes, ranks of a launcher, and from
// Python any object of the refit.WorkerGroup protocol: Ray actors, multiprocessing workers...).
// It is the one driver of refit; Python's refit.WeightSynchronizer is a binding of it.
//
//   first sync_weights():  memory query -> bucket size (once), create engines (once, one session),
//                          prepare -> metadata -> init_process_groups   ("ready")
//   every sync_weights():  one refit; with release_after_refit, shutdown() afterwards
//   a failed refit:        throws and leaves the synchronizer stale; shutdown() right away (a
//                          failure of that is only logged), and the next sync_weights() creates
//                          engines again with the same session and bucket size (workers that
//                          have one keep it: only a worker put in place of a lost one gets a new
//                          engine), then prepares again with fresh metadata
//   shutdown():            finalize every worker; the next sync prepares again with fresh metadata
// It never reports success when any worker failed: a worker that throws, or a destination that
// reports failure (WorkerRefitReport::failed, the reference's False result), fails the refit.
// Not thread-safe: one thread drives a synchronizer.
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
  // The worker reported failure without throwing (the reference's destination result False);
  // the synchronizer then fails the refit.
  bool failed = false;
  SendStats send;
  ReceiveStats receive;
  std::string detail;  // the worker program's own report (JSON text), e.g. tensor hashes
};

struct RefitReport {
  uint64_t index = 0;                      // set by the synchronizer: refits counted from 0
  double seconds = 0;                      // wall time of the refit; 0 from a group: the driver's own timing
  double start_time = 0;                   // when the refit started, on the timeline clock (timeline.h)
  std::vector<WorkerRefitReport> workers;  // sources first, then destinations, by rank
};

// The workers as the driver sees them: train_world_size() sources (policy ranks) and
// rollout_world_size() destinations (rollout ranks). Each call acts on every worker and returns
// when all have answered; a worker that fails makes the call throw (an Error naming it).
class WorkerGroup {
 public:
  virtual ~WorkerGroup() = default;
  virtual int train_world_size() const = 0;
  virtual int rollout_world_size() const = 0;
  // Total memory of each worker's transfer device, sources first.
  virtual std::vector<uint64_t> total_memory_bytes() = 0;
  // Gives every worker that has no engine one, with this bucket size and session; a worker that
  // has one keeps it. Called once, and again before the first sync after a failed refit (with
  // the same arguments) so that a worker put in place of a lost one gets its engine.
  virtual void create_engines(uint64_t bucket_bytes, const SessionId& session) = 0;
  // Metadata of every worker, sources first then destinations, each by rank. A worker whose last
  // refit failed should replace its engine first: messages of the failed refit may still be in
  // flight to the old one.
  virtual std::vector<Metadata> prepare() = 0;
  virtual void init_process_groups(std::span<const Metadata> metadata) = 0;
  // Runs one refit on every worker at once; one WorkerRefitReport per worker.
  virtual RefitReport refit(uint64_t index) = 0;
  virtual void finalize() = 0;
};

class WeightSynchronizer {
 public:
  // `backend`: the checkpoint-engine backend the workers create, named in the failure message
  // ("Weight transfer failed during nixl checkpoint-engine sync", as the reference says).
  WeightSynchronizer(RefitConfig config, WorkerGroup& workers, std::string backend = "nixl");

  // One refit; throws when any worker failed: the worker group's own error, Error(kTransport)
  // when a worker reported failure, Error(kTopology) when the group's metadata do not number
  // train_world_size + rollout_world_size. The synchronizer then stays stale.
  RefitReport sync_weights();
  // Creates engines (once, and again after a failed refit), prepares, exchanges metadata and
  // connects (once per ready epoch); sync_weights() calls it.
  void ensure_ready();
  // Finalizes every worker (engines, session and bucket size are kept); no-op unless ready.
  void shutdown();

  // True until a refit succeeds, and again from the start of every refit until it succeeds.
  bool stale() const { return stale_; }
  bool ready() const { return ready_; }
  // Resolved on first use from every worker's total memory and then fixed, as in the reference.
  const BucketSize& bucket_size();
  // The most bytes one source sends in a refit (the model's size, or its largest shard): bucket
  // sizing then makes no buffer larger (resolve_bucket_size). Call before the first refit.
  void set_model_bytes(uint64_t bytes) { model_bytes_ = bytes; }
  const std::string& backend() const { return backend_; }

 private:
  RefitReport refit_once();
  // shutdown(), logging (never throwing) a failure: `what` says when it ran.
  void release(const char* what) noexcept;

  RefitConfig config_;
  WorkerGroup& workers_;
  std::string backend_;
  std::optional<BucketSize> bucket_size_;
  uint64_t model_bytes_ = 0;
  std::optional<SessionId> session_;
  bool backend_logged_ = false;
  bool engines_created_ = false;
  bool ready_ = false;
  bool stale_ = true;
  uint64_t refits_ = 0;
};

}  // namespace refit
