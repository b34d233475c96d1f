// Both halves of the driver <-> worker protocol over Channels, shared by every process group
// (forked local processes, ranks started by a launcher on any host). The driver sends one command
// to every worker at once and gathers every answer within a deadline; the worker runs commands on
// its engine and its WorkerProgram.
#pragma once

#include <sys/types.h>

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "refit/synchronizer.h"
#include "refit/worker_program.h"
#include "sync/channel.h"

namespace refit {

struct WorkerLink {
  bool is_source = false;
  int rank = 0;
  pid_t pid = -1;       // in its host's PID namespace
  std::string host;     // empty: a child process on this host
  bool reaped = false;  // a local child whose exit was collected by waitpid
  Channel channel;

  // "source rank 0", or "source rank 0 on host h1" for a worker elsewhere.
  std::string label() const;
  // How a worker that closed its channel ended, as far as this host can tell.
  std::string exit_description();
};

class WorkerLinks {
 public:
  // `options` must outlive this object; its `destinations` may change between calls.
  explicit WorkerLinks(const GroupOptions& options) : options_(options) {}

  std::vector<std::unique_ptr<WorkerLink>>& links() { return links_; }
  const std::vector<std::unique_ptr<WorkerLink>>& links() const { return links_; }

  // WorkerGroup's operations, on every link.
  std::vector<uint64_t> total_memory_bytes();
  void create_engines(uint64_t bucket_bytes, const SessionId& session);
  std::vector<Metadata> prepare();
  void init_process_groups(std::span<const Metadata> metadata);
  RefitReport refit(uint64_t index);
  void finalize();

  // Creates the engine of one worker that joined after create_engines() (no-op before).
  void create_engine(WorkerLink& link);
  // Asks every worker to exit (they do so in parallel).
  void ask_all_to_exit();

 private:
  const GroupOptions& options_;
  std::vector<std::unique_ptr<WorkerLink>> links_;         // sources, then destinations, each by rank
  std::optional<std::pair<uint64_t, SessionId>> engines_;  // bucket size and session, once created
};

// The worker's side: runs the commands that arrive on `channel` until the driver says exit or
// goes away. Returns the process exit code.
int serve_worker(bool is_source, int rank, Channel& channel, const GroupOptions& options);

}  // namespace refit
