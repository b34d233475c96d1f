// The transfer plan: from what every source holds and what every destination needs, which bytes
// each destination reads from which source. Sources and destinations both declare layouts
// (layout.h) over the same model: a source's layout says which slice of each tensor it holds (its
// shard; dropped: not held), a destination's which slice it needs. The plan is a pure function
// of the layouts, so every peer that computes it gets the same one.
//
// Rules:
//  - every byte a destination needs comes from exactly one source, as a piece: a box of one
//    tensor (the source's slice intersected with the destination's, at most two cut dims);
//  - the sources holding a tensor must hold identical slices (replicas: data parallelism) or
//    disjoint ones (shards); a partial overlap is an error naming both sources;
//  - replicas share the work: each piece goes to the replica that has sent the fewest bytes so
//    far (ties go round-robin by destination), which balances every source's egress;
//  - a needed range that no source holds is an error naming the tensor, the range and the
//    destination; all of this before any transfer;
//  - a zero-byte need (an empty tensor, a vocabulary slice past the end) still gets a piece, so
//    its name is delivered.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "refit/layout.h"
#include "refit/model.h"

namespace refit {

// Which links' pieces a plan keeps. Every engine of a group computes the plan, but an engine
// needs only its own links: a source what it sends, a destination what it gets (with hundreds of
// sources, the whole plan is most of a small engine's memory). Everything else (which links
// exist, their bucket shares, every source's and destination's bytes) is the whole group's
// whatever the scope, so each engine agrees with the others on them.
struct PlanScope {
  enum class Kind : uint8_t { kAll, kSource, kDestination };
  Kind kind = Kind::kAll;
  uint32_t rank = 0;
  static PlanScope all() { return {}; }
  static PlanScope source(uint32_t s) { return {Kind::kSource, s}; }
  static PlanScope destination(uint32_t d) { return {Kind::kDestination, d}; }
  bool keeps(uint32_t source, uint32_t destination) const {
    return kind == Kind::kAll || (kind == Kind::kSource ? source == rank : destination == rank);
  }
};

struct TransferPiece {
  uint32_t tensor = 0;       // index into the model inventory
  uint32_t source = 0;       // source index
  uint32_t destination = 0;  // destination index
  Box box;                   // in the coordinates of the whole tensor
  uint64_t bytes = 0;
};

class TransferPlan {
 public:
  // The pieces the plan's scope keeps, ordered by destination, then source, then tensor.
  const std::vector<TransferPiece>& pieces() const { return pieces_; }
  // What `source` sends `destination`, in tensor order (empty when nothing). Throws
  // Error(kInternal) for a link outside the plan's scope: its pieces were not kept.
  std::span<const TransferPiece> link(uint32_t source, uint32_t destination) const;
  // The sources a destination reads from, and the destinations a source serves, ascending.
  std::vector<uint32_t> sources_of(uint32_t destination) const;
  std::vector<uint32_t> destinations_of(uint32_t source) const;
  // The bytes each of link (source, destination)'s two buffers holds: both ends split their two
  // buckets of `bucket_bytes` over their links and the link gets the smaller share, so both
  // compute it alike (and the planner as the engines do).
  uint64_t link_bucket_bytes(uint32_t source, uint32_t destination, uint64_t bucket_bytes) const;

  // The paired topology's plan (paired_plan): source i serves destination i with whatever its
  // weight stream yields, selected by the destination's layout; no pieces are planned ahead.
  bool paired() const { return paired_; }
  uint32_t source_count() const { return sources_; }
  uint32_t destination_count() const { return destinations_; }
  const std::vector<uint64_t>& egress() const { return egress_; }    // bytes each source sends
  const std::vector<uint64_t>& ingress() const { return ingress_; }  // bytes each destination receives

 private:
  friend TransferPlan plan_transfers(const ModelInventory&, std::span<const Layout>, std::span<const Layout>,
                                     PlanScope);
  friend TransferPlan paired_plan(int, int);
  bool has_link(uint32_t source, uint32_t destination) const;
  uint32_t sources_ = 0, destinations_ = 0;
  bool paired_ = false;
  PlanScope scope_;
  std::vector<TransferPiece> pieces_;  // of the links in scope
  // [destination * sources + source]: the link's pieces in the whole plan, and its first in pieces_
  // (links in scope; one past the end last).
  std::vector<uint32_t> link_pieces_;
  std::vector<uint64_t> link_begin_;
  std::vector<uint64_t> egress_, ingress_;
};

// Throws Error(kLayout) for an invalid layout (validate_layout, naming "source rank s" or
// "destination rank d"), partially overlapping source slices, and needed bytes no source holds;
// Error(kInvalidArgument) for no sources or no destinations, or a scope's rank out of range.
TransferPlan plan_transfers(const ModelInventory& model, std::span<const Layout> sources,
                            std::span<const Layout> destinations, PlanScope scope = PlanScope::all());

// The plan of the paired topology: `sources` >= `destinations`, source i -> destination i, the
// sources past the destinations idle. Throws Error(kTopology) otherwise, naming both counts.
TransferPlan paired_plan(int sources, int destinations);

}  // namespace refit
