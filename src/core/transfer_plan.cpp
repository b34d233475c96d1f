#include "refit/transfer_plan.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <thread>

#include "core/fail.h"
#include "core/layout_resolver.h"

namespace refit {
namespace {

// The sources holding one tensor, grouped: identical slices are replicas of one group; groups
// are disjoint ranges of one dim, in order. dim < 0: every holder has the whole tensor (one group).
struct Holdings {
  struct Group {
    int64_t start = 0, length = 0;
    std::vector<uint32_t> sources;
  };
  int32_t dim = -1;
  std::vector<Group> groups;
  uint32_t any_source = 0;  // some holder, for a zero-byte need
  bool empty = true;
};

struct Holder {
  uint32_t source;
  Request request;
};

Holdings group_holders(const TensorInfo& info, std::vector<Holder>& holders) {
  Holdings h;
  if (holders.empty()) return h;
  h.empty = false;
  h.any_source = holders.front().source;
  auto describe = [&](const Holder& x) {
    return x.request.take == Take::kWhole ? std::string("all of it") : "its " + to_string(Box::of(x.request));
  };
  auto overlap = [&](const Holder& a, const Holder& b) {
    fail(ErrorKind::kLayout,
         "source layouts overlap on tensor '{}' (shape {}): source rank {} holds {} and source rank {} holds {}; "
         "sources "
         "must hold identical slices (replicas) or disjoint ones (shards)",
         info.name, shape_string(info.shape), a.source, describe(a), b.source, describe(b));
  };
  // Zero-length slices hold nothing.
  std::vector<Holder> live;
  for (const auto& x : holders)
    if (x.request.take == Take::kWhole || x.request.slice.length > 0) live.push_back(x);
  if (live.empty()) return h;
  const Holder* whole = nullptr;
  const Holder* sliced = nullptr;
  for (const auto& x : live) {
    if (x.request.take == Take::kWhole && !whole) whole = &x;
    if (x.request.take == Take::kSlice && !sliced) sliced = &x;
  }
  if (whole && sliced) overlap(*whole, *sliced);
  if (whole) {
    h.groups.push_back({0, 0, {}});
    for (const auto& x : live) h.groups.back().sources.push_back(x.source);
    return h;
  }
  h.dim = live.front().request.slice.dim;
  for (const auto& x : live)
    if (x.request.slice.dim != h.dim) overlap(live.front(), x);  // slices of two dims always intersect
  std::stable_sort(live.begin(), live.end(), [](const Holder& a, const Holder& b) {
    return std::pair(a.request.slice.start, a.request.slice.length) <
           std::pair(b.request.slice.start, b.request.slice.length);
  });
  const Holder* previous = nullptr;
  for (const auto& x : live) {
    const Slice& s = x.request.slice;
    if (previous && previous->request.slice == s) {
      h.groups.back().sources.push_back(x.source);
      continue;
    }
    if (previous && s.start < previous->request.slice.start + previous->request.slice.length) overlap(*previous, x);
    h.groups.push_back({s.start, s.length, {x.source}});
    previous = &x;
  }
  return h;
}

// Resolves layouts[first, first + count) on all cores (each resolve is independent and reads
// tens of thousands of scattered names); out[k] gets layouts[first + k]'s requests. The first
// failing layout's error (in layout order) is rethrown, so errors do not depend on timing.
void resolve_batch(const LayoutResolver& resolver, std::span<const Layout> layouts, size_t first, size_t count,
                   LayoutRole role, std::vector<std::vector<Request>>& out) {
  out.resize(std::max(out.size(), count));
  std::vector<std::exception_ptr> errors(count);
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t k; (k = next++) < count;) {
      try {
        const char* who = role == LayoutRole::kSource ? "source" : "destination";
        resolver.resolve(layouts[first + k], role, fmt::format("{} rank {}", who, first + k), out[k]);
      } catch (...) {
        errors[k] = std::current_exception();
      }
    }
  };
  const size_t threads = std::min<size_t>(count, std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// Layouts resolved per batch: enough to keep every core busy, few enough that the resolved
// requests (one per tensor each) stay small.
size_t batch_size() { return 4 * std::max(1u, std::thread::hardware_concurrency()); }

}  // namespace

std::span<const TransferPiece> TransferPlan::link(uint32_t source, uint32_t destination) const {
  if (paired_ || source >= sources_ || destination >= destinations_) return {};
  if (!scope_.keeps(source, destination))
    fail(ErrorKind::kInternal, "the pieces of link source rank {} -> destination rank {} are outside this plan's scope",
         source, destination);
  const size_t k = static_cast<size_t>(destination) * sources_ + source;
  return {pieces_.data() + link_begin_[k], pieces_.data() + link_begin_[k + 1]};
}

bool TransferPlan::has_link(uint32_t source, uint32_t destination) const {
  return link_pieces_[static_cast<size_t>(destination) * sources_ + source] > 0;
}

std::vector<uint32_t> TransferPlan::sources_of(uint32_t destination) const {
  if (paired_) return destination < destinations_ ? std::vector<uint32_t>{destination} : std::vector<uint32_t>{};
  std::vector<uint32_t> out;
  for (uint32_t s = 0; s < sources_ && destination < destinations_; ++s)
    if (has_link(s, destination)) out.push_back(s);
  return out;
}

std::vector<uint32_t> TransferPlan::destinations_of(uint32_t source) const {
  if (paired_) return source < destinations_ ? std::vector<uint32_t>{source} : std::vector<uint32_t>{};
  std::vector<uint32_t> out;
  for (uint32_t d = 0; d < destinations_ && source < sources_; ++d)
    if (has_link(source, d)) out.push_back(d);
  return out;
}

uint64_t TransferPlan::link_bucket_bytes(uint32_t source, uint32_t destination, uint64_t bucket_bytes) const {
  const uint64_t ways = std::max(destinations_of(source).size(), sources_of(destination).size());
  if (ways <= 1) return bucket_bytes;  // the link's buffers are the engine's
  uint64_t bytes = bucket_bytes / std::max<uint64_t>(ways, 1);
  if (bytes >= 4096) bytes &= ~uint64_t{255};  // keep chunk offsets aligned
  return std::max<uint64_t>(bytes, 1);
}

TransferPlan plan_transfers(const ModelInventory& model, std::span<const Layout> sources,
                            std::span<const Layout> destinations, PlanScope scope) {
  if (sources.empty() || destinations.empty())
    fail(ErrorKind::kInvalidArgument, "a transfer plan needs at least one source and one destination (got {} and {})",
         sources.size(), destinations.size());
  if (scope.kind != PlanScope::Kind::kAll &&
      scope.rank >= (scope.kind == PlanScope::Kind::kSource ? sources.size() : destinations.size()))
    fail(ErrorKind::kInvalidArgument, "a plan scoped to {} rank {} of a group of {} sources and {} destinations",
         scope.kind == PlanScope::Kind::kSource ? "source" : "destination", scope.rank, sources.size(),
         destinations.size());
  const auto& tensors = model.tensors;
  const uint32_t S = static_cast<uint32_t>(sources.size()), D = static_cast<uint32_t>(destinations.size());
  const LayoutResolver resolver(model);
  std::vector<std::vector<Request>> resolved;

  std::vector<std::vector<Holder>> holders(tensors.size());
  for (uint32_t first = 0; first < S; first += batch_size()) {
    const uint32_t count = std::min<uint32_t>(batch_size(), S - first);
    resolve_batch(resolver, sources, first, count, LayoutRole::kSource, resolved);
    for (uint32_t k = 0; k < count; ++k)
      for (uint32_t i = 0; i < resolved[k].size(); ++i)
        if (resolved[k][i].take != Take::kDrop) holders[i].push_back({first + k, resolved[k][i]});
  }
  std::vector<Holdings> held(tensors.size());
  std::vector<bool> grouped(tensors.size(), false);

  TransferPlan plan;
  plan.sources_ = S;
  plan.destinations_ = D;
  plan.scope_ = scope;
  plan.link_pieces_.assign(static_cast<size_t>(D) * S, 0);
  plan.egress_.assign(S, 0);
  plan.ingress_.assign(D, 0);
  std::vector<TransferPiece> pieces;  // of one destination, in tensor order
  plan.link_begin_.assign(static_cast<size_t>(D) * S + 1, 0);
  // The replica that has sent least so far; among equals, round-robin by destination.
  auto pick = [&](const std::vector<uint32_t>& replicas, uint32_t d) {
    const size_t n = replicas.size();
    uint32_t best = replicas[d % n];
    for (size_t k = 1; k < n; ++k) {
      const uint32_t s = replicas[(d + k) % n];
      if (plan.egress_[s] < plan.egress_[best]) best = s;
    }
    return best;
  };
  auto emit = [&](uint32_t i, uint32_t s, uint32_t d, const Box& box) {
    const uint64_t bytes = box.nbytes_in(tensors[i]);
    pieces.push_back({i, s, d, box, bytes});
    plan.egress_[s] += bytes;
    plan.ingress_[d] += bytes;
  };

  for (uint32_t d = 0; d < D; ++d) {
    if (d % batch_size() == 0)
      resolve_batch(resolver, destinations, d, std::min<size_t>(batch_size(), D - d), LayoutRole::kDestination,
                    resolved);
    const std::vector<Request>& requests = resolved[d % batch_size()];
    pieces.clear();
    for (uint32_t i = 0; i < requests.size(); ++i) {
      if (requests[i].take == Take::kDrop) continue;
      const TensorInfo& info = tensors[i];
      if (!grouped[i]) {
        held[i] = group_holders(info, holders[i]);
        grouped[i] = true;
      }
      const Holdings& h = held[i];
      const Box need = Box::of(requests[i]);
      if (h.empty)
        fail(ErrorKind::kLayout,
             "destination rank {} needs {} of tensor '{}' (shape {}), but no source holds any of it", d,
             to_string(need), info.name, shape_string(info.shape));
      if (need.nbytes_in(info) == 0) {
        emit(i, h.groups.empty() ? h.any_source : pick(h.groups.front().sources, d), d, need);
        continue;
      }
      if (h.dim < 0) {
        emit(i, pick(h.groups.front().sources, d), d, need);
        continue;
      }
      const Slice range = need.along(h.dim, info.shape);
      int64_t cursor = range.start;
      const int64_t end = range.start + range.length;
      auto missing = [&](int64_t from, int64_t to) {
        fail(ErrorKind::kLayout,
             "destination rank {} needs {} of tensor '{}' (shape {}), but no source holds dim {} [{}, {}) of it", d,
             to_string(need), info.name, shape_string(info.shape), h.dim, from, to);
      };
      auto g = std::partition_point(h.groups.begin(), h.groups.end(),
                                    [&](const Holdings::Group& x) { return x.start + x.length <= cursor; });
      for (; g != h.groups.end() && g->start < end; ++g) {
        if (g->start > cursor) missing(cursor, g->start);
        const int64_t hi = std::min(end, g->start + g->length);
        emit(i, pick(g->sources, d), d, need.narrowed({h.dim, cursor, hi - cursor}));
        cursor = hi;
      }
      if (cursor < end) missing(cursor, end);
    }
    // The links in scope keep their pieces, appended by source (a stable counting sort), tensor
    // order within each link.
    const size_t base = static_cast<size_t>(d) * S, offset = plan.pieces_.size();
    std::vector<uint64_t> count(S + 1, 0);
    for (const auto& p : pieces) {
      ++plan.link_pieces_[base + p.source];
      if (scope.keeps(p.source, d)) ++count[p.source + 1];
    }
    for (uint32_t s = 0; s < S; ++s) {
      count[s + 1] += count[s];
      plan.link_begin_[base + s] = offset + count[s];
    }
    plan.pieces_.resize(offset + count[S]);
    for (const auto& p : pieces)
      if (scope.keeps(p.source, d)) plan.pieces_[offset + count[p.source]++] = p;
  }
  plan.link_begin_.back() = plan.pieces_.size();
  return plan;
}

TransferPlan paired_plan(int sources, int destinations) {
  if (sources < 1 || destinations < 1)
    fail(ErrorKind::kTopology, "world sizes must be >= 1, got train_world_size={} rollout_world_size={}", sources,
         destinations);
  if (sources < destinations)
    fail(ErrorKind::kTopology,
         "paired refit needs train_world_size >= rollout_world_size (every destination needs its own source), got {} < "
         "{}",
         sources, destinations);
  TransferPlan plan;
  plan.paired_ = true;
  plan.sources_ = static_cast<uint32_t>(sources);
  plan.destinations_ = static_cast<uint32_t>(destinations);
  plan.egress_.assign(plan.sources_, 0);
  plan.ingress_.assign(plan.destinations_, 0);
  return plan;
}

}  // namespace refit
