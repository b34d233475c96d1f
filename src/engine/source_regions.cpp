#include "engine/source_regions.h"

#include <spdlog/spdlog.h>

#include "refit/ext/device_memory.h"

namespace refit {

SourceRegions::~SourceRegions() {
  while (!by_base_.empty()) drop(by_base_.begin());
}

bool SourceRegions::registrable(MemoryKind kind, SourceAccess access) const {
  const TransportCapabilities caps = transport_->capabilities();
  const bool reachable = access == SourceAccess::kMap ? caps.maps_registered_memory : caps.reads_registered_memory;
  return reachable && (kind == MemoryKind::kCuda ? caps.device_memory : caps.host_memory);
}

void SourceRegions::drop(std::map<const std::byte*, Registration>::iterator it) {
  try {
    transport_->deregister_memory(it->second.region);
  } catch (const std::exception& e) {
    spdlog::warn("dropping the registration of source memory at {}: {}", static_cast<const void*>(it->first), e.what());
  }
  by_base_.erase(it);
}

std::optional<SourceRegions::Found> SourceRegions::find(const std::byte* data, uint64_t bytes, MemoryKind kind,
                                                        SourceAccess access, bool register_new) {
  if (data == nullptr || bytes == 0) return std::nullopt;
  auto it = by_base_.upper_bound(data);
  if (it != by_base_.begin()) {
    --it;
    Registration& r = it->second;
    const uint64_t offset = static_cast<uint64_t>(data - it->first);
    const bool inside = offset <= r.bytes && bytes <= r.bytes - offset && r.remote.memory == kind;
    // A registration made for readers may be one that mappers cannot reach.
    if (inside && !r.allocated && !registrable(kind, access)) return std::nullopt;
    if (inside && (r.allocated || r.used_in == refit_ || transport_->registration_current(r.region))) {
      r.used_in = refit_;
      return Found{r.region, &r.remote, offset};
    }
    if (inside) {
      spdlog::debug("source memory at {} was replaced since it was registered: registering it again",
                    static_cast<const void*>(it->first));
      drop(it);
    }
  }
  if (!register_new || !registrable(kind, access) || memory_kind_of(data) != kind) return std::nullopt;
  Registration r;
  Transport::Extent extent;
  try {
    extent = transport_->registration_extent(data, bytes);
    if (extent.base > data || bytes > extent.bytes || static_cast<uint64_t>(data - extent.base) > extent.bytes - bytes)
      extent = {data, bytes};  // not around the bytes asked for: those alone
    r.region = transport_->register_memory(const_cast<std::byte*>(extent.base), extent.bytes);
  } catch (const Error& e) {
    spdlog::debug("source memory at {} ({} bytes) cannot be read in place, so it goes through buckets: {}",
                  static_cast<const void*>(data), bytes, e.what());
    return std::nullopt;
  }
  r.bytes = extent.bytes;
  r.remote = {transport_->describe(r.region), kind};
  r.used_in = refit_;
  // A registration starting where a stale one did (the same allocation base) replaces it; our
  // own allocation stays (a tensor running past its end goes through buckets).
  if (auto same = by_base_.find(extent.base); same != by_base_.end()) {
    if (same->second.allocated) {
      transport_->deregister_memory(r.region);
      return std::nullopt;
    }
    drop(same);
  }
  auto placed = by_base_.emplace(extent.base, std::move(r)).first;
  return Found{placed->second.region, &placed->second.remote, static_cast<uint64_t>(data - extent.base)};
}

std::byte* SourceRegions::allocate(uint64_t bytes) {
  Transport::Allocation a = transport_->allocate_memory(bytes);
  by_base_.emplace(a.base, Registration{.region = a.region,
                                        .bytes = bytes,
                                        .remote = {transport_->describe(a.region), memory_kind_of(a.base)},
                                        .allocated = true});
  return a.base;
}

void SourceRegions::end_refit() {
  for (auto it = by_base_.begin(); it != by_base_.end();) {
    auto next = std::next(it);
    if (!it->second.allocated && it->second.used_in != refit_) drop(it);
    it = next;
  }
  ++refit_;
}

}  // namespace refit
