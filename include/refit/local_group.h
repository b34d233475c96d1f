// A WorkerGroup of processes on this host, for the `refit` tools and for tests: the driver
// forks one process per source and per destination and talks to each over a socket pair.
// What a worker does with its engine (which weights it sends, how it loads what it receives)
// is a WorkerProgram, created inside the worker process after the fork.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <sys/types.h>
#include <vector>

#include "refit/checkpoint_engine.h"
#include "refit/config.h"
#include "refit/layout.h"
#include "refit/synchronizer.h"

namespace refit {

class WorkerProgram {
 public:
  virtual ~WorkerProgram() = default;
  // Before refit `index` starts (not timed): a source makes its weights ready.
  virtual void stage(uint64_t index) {}
  // The weights a source sends in refit `index`.
  virtual std::unique_ptr<WeightSource> weights(uint64_t index) = 0;
  // The loader a destination uses in refit `index`.
  virtual BatchLoader loader(uint64_t index) = 0;
  // After refit `index`: a report for the driver (JSON text), e.g. per-tensor hashes.
  virtual std::string report(uint64_t index) { return "{}"; }
};

using WorkerProgramFactory = std::function<std::unique_ptr<WorkerProgram>(bool is_source, int rank)>;

struct LocalGroupOptions {
  RefitConfig config;
  int sources = 1;
  int destinations = 1;
  uint64_t model_fingerprint = 0;
  WorkerProgramFactory program;
  // Destination r's layout (layout.h); missing or empty entries mean every tensor whole.
  std::vector<std::optional<Layout>> destination_layouts;
};

class LocalProcessGroup final : public WorkerGroup {
 public:
  // Forks the workers. Throws Error(kTopology) for non-positive counts.
  explicit LocalProcessGroup(LocalGroupOptions options);
  // Asks every worker to exit, then kills whatever is left; never waits without a deadline.
  ~LocalProcessGroup() override;

  int train_world_size() const override { return options_.sources; }
  int rollout_world_size() const override { return options_.destinations; }
  std::vector<uint64_t> total_memory_bytes() override;
  void create_engines(uint64_t bucket_bytes, const SessionId& session) override;
  std::vector<Metadata> prepare() override;
  void init_process_groups(std::span<const Metadata> metadata) override;
  RefitReport refit(uint64_t index) override;
  void finalize() override;

  // Worker pids, sources first (for tests that kill a worker).
  std::vector<pid_t> pids() const;

  // Elastic membership: stops destinations of rank >= `destinations` and starts new ones (with
  // engines, if engines exist). Call between refits, after shutdown, then refit again: the
  // synchronizer prepares and exchanges fresh metadata with the new set.
  void set_destinations(int destinations);

  // Starts a new process (with an engine, if engines exist) in place of every worker that has
  // exited, with the same role and rank; returns their labels. Then shut the synchronizer down
  // and refit again: survivors and replacements exchange fresh metadata.
  std::vector<std::string> replace_lost_workers();

  struct Worker;  // private to local_group.cpp

 private:
  std::unique_ptr<Worker> spawn(bool is_source, int rank);
  void create_engine(Worker& worker);
  static void stop(Worker& worker, Deadline deadline);

  LocalGroupOptions options_;
  std::vector<std::unique_ptr<Worker>> workers_;  // sources, then destinations, each by rank
  std::optional<std::pair<uint64_t, SessionId>> engines_;  // bucket size and session, once created
};

}  // namespace refit
