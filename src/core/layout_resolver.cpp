#include "core/layout_resolver.h"

#include <algorithm>

#include "core/fail.h"

namespace refit {

LayoutResolver::LayoutResolver(const ModelInventory& inventory)
    : inventory_(inventory), scales_(fp8_scales_of(inventory)) {}

const std::vector<uint32_t>& LayoutResolver::sorted() const {
  std::call_once(sorted_once_, [&] {
    const auto& tensors = inventory_.tensors;
    sorted_.resize(tensors.size());
    for (uint32_t i = 0; i < tensors.size(); ++i) sorted_[i] = i;
    std::sort(sorted_.begin(), sorted_.end(),
              [&](uint32_t a, uint32_t b) { return tensors[a].name < tensors[b].name; });
  });
  return sorted_;
}

void LayoutResolver::resolve(const Layout& layout, LayoutRole role, std::string_view owner,
                             std::vector<Request>& out) const {
  const auto& tensors = inventory_.tensors;
  if (layout.fallback == Take::kSlice)
    fail(ErrorKind::kLayout, "layout of {}: the fallback must be whole or drop, not slice", owner);
  out.assign(tensors.size(), layout.fallback == Take::kDrop ? Request::drop() : Request::whole());
  std::vector<const std::string*> dropped_by;  // the prefix that drops each tensor
  if (!layout.drop_prefixes.empty()) dropped_by.assign(tensors.size(), nullptr);
  for (const auto& p : layout.drop_prefixes) {
    // "model.layers.1" would also drop model.layers.10..19.
    if (p.empty() || p.back() != '.')
      fail(ErrorKind::kLayout, "layout of {}: dropped prefix '{}' must be non-empty and end with '.'", owner, p);
    // The names starting with p form one range of the sorted order: from p up to p with its
    // final '.' raised to '/'. Marking it by index reads no names (they are scattered in memory).
    auto before = [&](uint32_t i, const std::string& key) { return tensors[i].name < key; };
    std::string end_key = p;
    end_key.back() = '.' + 1;
    const auto& order = sorted();
    auto first = std::lower_bound(order.begin(), order.end(), p, before);
    auto last = std::lower_bound(first, order.end(), end_key, before);
    for (auto it = first; it != last; ++it) {
      out[*it] = Request::drop();
      dropped_by[*it] = &p;
    }
  }
  // The entries come in name order, as the sorted inventory does: each is found by moving a cursor
  // forward (one step when the layout lists most tensors, a binary search when it lists few),
  // with no hashing of long names.
  const auto& order = sorted();
  auto cursor = order.begin();
  for (const auto& [name, request] : layout.tensors) {
    if (cursor == order.end() || tensors[*cursor].name != name)
      cursor = std::lower_bound(cursor, order.end(), name,
                                [&](uint32_t i, const std::string& key) { return tensors[i].name < key; });
    if (cursor == order.end() || tensors[*cursor].name != name)
      fail(ErrorKind::kLayout, "layout of {} lists tensor '{}', which model '{}' does not have", owner, name,
           inventory_.name);
    const uint32_t index = *cursor++;
    const TensorInfo& info = tensors[index];
    Request r = request;
    if (r.take == Take::kSlice) {
      if (auto problem = slice_problem(info, r.slice); !problem.empty())
        fail(ErrorKind::kLayout, "layout of {}: tensor '{}': {}", owner, name, problem);
      if (r.slice.start == 0 && r.slice.length == info.shape[r.slice.dim]) r = Request::whole();
    }
    if (r.take != Take::kDrop && !dropped_by.empty() && dropped_by[index])
      fail(ErrorKind::kLayout, "layout of {} asks for tensor '{}' ({}) but also drops its prefix '{}'", owner, name,
           to_string(request.take), *dropped_by[index]);
    out[index] = r;
  }
  if (role == LayoutRole::kDestination) check_fp8_scales(out, owner);
}

void LayoutResolver::check_fp8_scales(std::span<const Request> requests, std::string_view owner) const {
  auto text = [](const Request& r) { return r.take == Take::kDrop ? std::string("drop") : to_string(Box::of(r)); };
  for (const auto& link : scales_) {
    const Request need = fp8_scale_request(inventory_, link, requests[link.weight], owner);
    if (requests[link.scale] == need) continue;
    fail(ErrorKind::kLayout,
         "layout of {} asks for FP8 scale '{}' as {} but for its weight '{}' as {}, which needs {} of the scale "
         "(add_fp8_scale_requests gives a layout its scales)",
         owner, inventory_.tensors[link.scale].name, text(requests[link.scale]), inventory_.tensors[link.weight].name,
         text(requests[link.weight]), text(need));
  }
}

}  // namespace refit
