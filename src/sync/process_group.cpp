#include "refit/process_group.h"

#include "sync/worker_links.h"

namespace refit {

ProcessGroup::ProcessGroup(GroupOptions options)
    : options_(std::move(options)), links_(std::make_unique<WorkerLinks>(options_)) {}
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
