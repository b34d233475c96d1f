// A WorkerGroup of processes on this host, for the `refit` tools and for tests: the driver
// forks one process per source and per destination and talks to each over a socket pair.
// What a worker does with its engine is a WorkerProgram (worker_program.h), created inside the
// worker process after the fork.
#pragma once

#include <sys/types.h>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "refit/process_group.h"
#include "refit/synchronizer.h"
#include "refit/worker_program.h"

namespace refit {

class LocalProcessGroup final : public ProcessGroup {
 public:
  // Forks the workers. Throws Error(kTopology) for non-positive counts.
  explicit LocalProcessGroup(GroupOptions options);
  // Asks every worker to exit, then kills whatever is left; never waits without a deadline.
  ~LocalProcessGroup() override;

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
};

}  // namespace refit
