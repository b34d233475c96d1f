#include "refit/process_group.h"

#include "core/fail.h"
#include "refit/transfer_plan.h"

#include "sync/worker_links.h"

namespace refit {

ProcessGroup::ProcessGroup(GroupOptions options)
    : options_(std::move(options)), links_(std::make_unique<WorkerLinks>(options_)) {}

void ProcessGroup::check_topology(const GroupOptions& o) {
  if (o.config.uses_plugin())
    fail(ErrorKind::kConfig,
         "refit_transport '{}' is a Python checkpoint-engine plugin: refit's process groups run the C++ engine; "
         "drive a plugin from Python (refit.WeightSynchronizer with a Python worker group)",
         o.config.refit_transport);
  if (o.source_layouts.empty()) {
    source_rank_for_destination(0, o.sources, o.destinations);
    return;
  }
  if (static_cast<int>(o.source_layouts.size()) != o.sources)
    fail(ErrorKind::kTopology, "{} source layouts for {} sources", o.source_layouts.size(), o.sources);
  if (!o.model) fail(ErrorKind::kConfig, "resharding needs the model's inventory (GroupOptions::model)");
  std::vector<Layout> needs(o.destinations);
  for (int d = 0; d < o.destinations && d < static_cast<int>(o.destination_layouts.size()); ++d)
    if (o.destination_layouts[d]) needs[d] = *o.destination_layouts[d];
  plan_transfers(*o.model, o.source_layouts, needs);
}

ProcessGroup::~ProcessGroup() = default;

std::vector<uint64_t> ProcessGroup::total_memory_bytes() { return links_->total_memory_bytes(); }
void ProcessGroup::create_engines(uint64_t bucket_bytes, const SessionId& session) {
  links_->create_engines(bucket_bytes, session);
}
std::vector<Metadata> ProcessGroup::prepare() { return links_->prepare(); }
void ProcessGroup::init_process_groups(std::span<const Metadata> metadata) { links_->init_process_groups(metadata); }
RefitReport ProcessGroup::refit(uint64_t index) { return links_->refit(index); }
void ProcessGroup::finalize() { links_->finalize(); }

}  // namespace refit
