// What the process groups share (local_group.h: forked processes; rank_group.h: ranks of a
// launcher): one channel per worker process, each WorkerGroup call sent to every worker at once
// and every answer gathered within a deadline, one error naming every worker that failed.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "refit/synchronizer.h"
#include "refit/worker_program.h"

namespace refit {

class WorkerLinks;  // private to src/sync

class ProcessGroup : public WorkerGroup {
 public:
  ~ProcessGroup() override;

  int train_world_size() const override { return options_.sources; }
  int rollout_world_size() const override { return options_.destinations; }
  std::vector<uint64_t> total_memory_bytes() override;
  void create_engines(uint64_t bucket_bytes, const SessionId& session) override;
  std::vector<Metadata> prepare() override;
  void init_process_groups(std::span<const Metadata> metadata) override;
  RefitReport refit(uint64_t index) override;
  void finalize() override;

  // Refuses a group that cannot refit, before any process starts: the paired topology's rules,
  // or, when resharding, a transfer plan that cannot be made (a needed slice nobody holds).
  static void check_topology(const GroupOptions& options);

 protected:
  explicit ProcessGroup(GroupOptions options);

  GroupOptions options_;
  std::unique_ptr<WorkerLinks> links_;  // refers to options_
};

}  // namespace refit
