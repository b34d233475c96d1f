// A source's registrations of its own tensor memory, so that destinations on its host can load
// tensors straight from it (direct_reads: one copy per byte, no bucket on either side), and
// destinations elsewhere can read them without the source packing them. The
// training side's parameters stay where they are from one refit to the next, so registrations
// are kept across refits; one the transport says was replaced (memory freed and allocated again)
// is made again, and one that no refit used since the previous refit is dropped.
#pragma once

#include <cstdint>
#include <map>
#include <optional>

#include "engine/protocol.h"
#include "refit/ext/transport.h"
#include "refit/tensor.h"

namespace refit {

class SourceRegions {
 public:
  struct Found {
    RegionId region = 0;                   // our registration
    const protocol::SourceRegion* remote;  // what a peer needs to map it
    uint64_t offset = 0;                   // of the bytes asked for, in the region
  };

  explicit SourceRegions(Transport* transport) : transport_(transport) {}
  ~SourceRegions();
  SourceRegions(const SourceRegions&) = delete;
  SourceRegions& operator=(const SourceRegions&) = delete;

  // The registered memory holding [data, data + bytes) of `kind`: memory from allocate(), or a
  // registration of those bytes made now (or in an earlier refit) when the transport lets peers
  // map (or read) registered memory of that kind. Nothing when the bytes cannot go in place.
  // `access`: how a peer reaches the memory, kMap (Transport::map) or kRead (Transport::post_read).
  // `register_new` false: only memory registered already.
  std::optional<Found> find(const std::byte* data, uint64_t bytes, MemoryKind kind, SourceAccess access,
                            bool register_new = true);
  // Memory for a source's weights, from the transport (a local peer maps it even where the
  // transport cannot map registered memory, as UCX's shared memory); freed with this object.
  std::byte* allocate(uint64_t bytes);
  // Ends a refit: drops the registrations it did not use.
  void end_refit();

 private:
  struct Registration {
    RegionId region = 0;
    uint64_t bytes = 0;
    protocol::SourceRegion remote;
    bool allocated = false;
    uint64_t used_in = 0;  // the refit that last used it
  };
  bool registrable(MemoryKind kind, SourceAccess access) const;
  void drop(std::map<const std::byte*, Registration>::iterator it);

  Transport* transport_;
  std::map<const std::byte*, Registration> by_base_;
  uint64_t refit_ = 1;
};

}  // namespace refit
