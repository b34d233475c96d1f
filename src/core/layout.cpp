#include "refit/layout.h"

#include <algorithm>
#include <cstring>

#include "core/fail.h"
#include "core/layout_resolver.h"
#include "core/wire.h"
#include "refit/ext/box_copy.h"

namespace refit {
namespace {

constexpr uint32_t kMagic = 0x594C4652;  // "RFLY"
constexpr uint16_t kVersion = 1;
// Caps on decoded input beyond "fits in the message": a layout lists at most every tensor of
// a model (DeepSeek-V3 has ~45k), a name is a dotted path, a tensor has a handful of dims.
constexpr uint64_t kMaxEntries = uint64_t{1} << 24;
constexpr uint64_t kMaxPrefixes = uint64_t{1} << 16;
constexpr size_t kMaxNameBytes = 4096;
constexpr int32_t kMaxDims = 64;

bool covers_dim(const TensorInfo& info, const Slice& s) { return s.start == 0 && s.length == info.shape[s.dim]; }

void check_name(const ByteReader& r, std::string_view name, const char* field) {
  if (name.empty()) fail(ErrorKind::kProtocol, "malformed {}: field '{}' is empty", r.what(), field);
  if (name.size() > kMaxNameBytes)
    fail(ErrorKind::kProtocol, "malformed {}: field '{}' is {} bytes (limit {})", r.what(), field, name.size(),
         kMaxNameBytes);
}

}  // namespace

std::string slice_problem(const TensorInfo& info, const Slice& s) {
  const auto ndim = static_cast<int64_t>(info.shape.size());
  if (s.dim < 0 || s.dim >= ndim)
    return fmt::format("slice dim {} is out of range for a {}-D tensor of shape {}", s.dim, ndim,
                       shape_string(info.shape));
  const int64_t size = info.shape[s.dim];
  if (s.start < 0 || s.length < 0 || s.start > size || s.length > size - s.start)
    return fmt::format("slice [{}, {}+{}) of dim {} is outside its size {} (shape {})", s.start, s.start, s.length,
                       s.dim, size, shape_string(info.shape));
  return {};
}

std::string_view to_string(Take take) {
  switch (take) {
    case Take::kWhole:
      return "whole";
    case Take::kSlice:
      return "slice";
    case Take::kDrop:
      return "drop";
  }
  return "invalid";
}

Request Layout::request_for(std::string_view name) const {
  if (auto it = tensors.find(name); it != tensors.end()) return it->second;
  for (const auto& p : drop_prefixes)
    if (name.starts_with(p)) return Request::drop();
  return fallback == Take::kDrop ? Request::drop() : Request::whole();
}

Selection select(const Layout& layout, const TensorInfo& source) {
  Request req = layout.request_for(source.name);
  Selection out{req.take, req.slice, source};
  if (req.take != Take::kSlice) return out;
  if (auto problem = slice_problem(source, req.slice); !problem.empty())
    fail(ErrorKind::kLayout, "layout entry for tensor '{}' does not fit it: {}", source.name, problem);
  if (covers_dim(source, req.slice)) {
    out.take = Take::kWhole;
    out.slice = {};
    return out;
  }
  out.info.shape[req.slice.dim] = req.slice.length;
  return out;
}

Box Box::of(const Request& request) {
  Box box;
  if (request.take == Take::kSlice) {
    box.cuts[0] = request.slice;
    box.count = 1;
  }
  return box;
}

Box Box::narrowed(const Slice& slice) const {
  Box out = *this;
  for (int i = 0; i < out.count; ++i) {
    Slice& cut = out.cuts[i];
    if (cut.dim != slice.dim) continue;
    const int64_t start = std::max(cut.start, slice.start);
    const int64_t end = std::min(cut.start + cut.length, slice.start + slice.length);
    cut.start = start;
    cut.length = std::max<int64_t>(0, end - start);
    return out;
  }
  if (out.count == kMaxCuts)
    fail(ErrorKind::kLayout, "a block cut along dims {} and {} cannot be cut along dim {} too", out.cuts[0].dim,
         out.cuts[1].dim, slice.dim);
  out.cuts[out.count++] = slice;
  if (out.count == 2 && out.cuts[1].dim < out.cuts[0].dim) std::swap(out.cuts[0], out.cuts[1]);
  return out;
}

Slice Box::along(int32_t dim, std::span<const int64_t> shape) const {
  for (int i = 0; i < count; ++i)
    if (cuts[i].dim == dim) return cuts[i];
  return {dim, 0, shape[dim]};
}

std::vector<int64_t> Box::shape_in(std::span<const int64_t> shape) const {
  std::vector<int64_t> out(shape.begin(), shape.end());
  for (int i = 0; i < count; ++i) out[cuts[i].dim] = cuts[i].length;
  return out;
}

uint64_t Box::nbytes_in(const TensorInfo& tensor) const {
  uint64_t n = dtype_size(tensor.dtype);
  for (size_t d = 0; d < tensor.shape.size(); ++d)
    n *= static_cast<uint64_t>(along(static_cast<int32_t>(d), tensor.shape).length);
  return n;
}

Box Box::relative_to(const Slice& origin) const {
  Box out = *this;
  for (int i = 0; i < out.count; ++i)
    if (out.cuts[i].dim == origin.dim) out.cuts[i].start -= origin.start;
  return out;
}

std::string to_string(const Box& box) {
  if (box.is_whole()) return "whole";
  std::string out;
  for (int i = 0; i < box.count; ++i) {
    const Slice& c = box.cuts[i];
    // A box decoded from a peer may be garbage: its end is only shown when it does not overflow.
    const bool sane = c.start >= 0 && c.length >= 0 && c.length <= INT64_MAX - c.start;
    out += sane ? fmt::format("{}dim {} [{}, {})", i ? " x " : "", c.dim, c.start, c.start + c.length)
                : fmt::format("{}dim {} [{}, +{})", i ? " x " : "", c.dim, c.start, c.length);
  }
  return out;
}

std::vector<uint8_t> encode_layout(const Layout& layout) {
  ByteWriter w;
  w.put<uint32_t>(kMagic);
  w.put<uint16_t>(kVersion);
  w.put<uint8_t>(static_cast<uint8_t>(layout.fallback));
  w.put<uint64_t>(layout.drop_prefixes.size());
  for (const auto& p : layout.drop_prefixes) w.put_string(p);
  w.put<uint64_t>(layout.tensors.size());
  for (const auto& [name, req] : layout.tensors) {
    w.put_string(name);
    w.put<uint8_t>(static_cast<uint8_t>(req.take));
    if (req.take == Take::kSlice) {
      w.put<int32_t>(req.slice.dim);
      w.put<int64_t>(req.slice.start);
      w.put<int64_t>(req.slice.length);
    }
  }
  return w.take();
}

Layout decode_layout(std::span<const uint8_t> bytes, std::string_view what) {
  ByteReader r(bytes, std::string(what));
  if (auto magic = r.get<uint32_t>("magic"); magic != kMagic)
    fail(ErrorKind::kProtocol, "malformed {}: field 'magic' is {:#x}, not a layout ({:#x})", r.what(), magic, kMagic);
  if (auto version = r.get<uint16_t>("version"); version != kVersion)
    fail(ErrorKind::kProtocol, "malformed {}: field 'version' is {}, this build reads {}", r.what(), version, kVersion);

  Layout layout;
  auto fallback = r.get<uint8_t>("fallback");
  if (fallback != static_cast<uint8_t>(Take::kWhole) && fallback != static_cast<uint8_t>(Take::kDrop))
    fail(ErrorKind::kProtocol, "malformed {}: field 'fallback' is {} (expected 0 = whole or 2 = drop)", r.what(),
         fallback);
  layout.fallback = static_cast<Take>(fallback);

  // Each string costs at least its 8-byte length.
  uint64_t prefixes = r.get_count("drop_prefixes", 8);
  if (prefixes > kMaxPrefixes)
    fail(ErrorKind::kProtocol, "malformed {}: field 'drop_prefixes' count {} exceeds {}", r.what(), prefixes,
         kMaxPrefixes);
  layout.drop_prefixes.reserve(prefixes);
  for (uint64_t i = 0; i < prefixes; ++i) {
    auto p = r.get_string("drop_prefix");
    check_name(r, p, "drop_prefix");
    layout.drop_prefixes.push_back(std::move(p));
  }

  // An entry is at least a name length and a take byte.
  uint64_t entries = r.get_count("tensors", 9);
  if (entries > kMaxEntries)
    fail(ErrorKind::kProtocol, "malformed {}: field 'tensors' count {} exceeds {}", r.what(), entries, kMaxEntries);
  for (uint64_t i = 0; i < entries; ++i) {
    auto name = r.get_string("tensor.name");
    check_name(r, name, "tensor.name");
    Request req;
    auto take = r.get<uint8_t>("tensor.take");
    if (take > static_cast<uint8_t>(Take::kDrop))
      fail(ErrorKind::kProtocol, "malformed {}: field 'tensor.take' of '{}' is {} (expected 0..2)", r.what(), name,
           take);
    req.take = static_cast<Take>(take);
    if (req.take == Take::kSlice) {
      req.slice.dim = r.get<int32_t>("tensor.slice.dim");
      req.slice.start = r.get<int64_t>("tensor.slice.start");
      req.slice.length = r.get<int64_t>("tensor.slice.length");
      if (req.slice.dim < 0 || req.slice.dim >= kMaxDims)
        fail(ErrorKind::kProtocol, "malformed {}: field 'tensor.slice.dim' of '{}' is {}", r.what(), name,
             req.slice.dim);
      if (req.slice.start < 0 || req.slice.length < 0 || req.slice.length > INT64_MAX - req.slice.start)
        fail(ErrorKind::kProtocol, "malformed {}: field 'tensor.slice' of '{}' is start {} length {}", r.what(), name,
             req.slice.start, req.slice.length);
    }
    // try_emplace leaves `name` intact when the key exists.
    if (!layout.tensors.try_emplace(std::move(name), req).second)
      fail(ErrorKind::kProtocol, "malformed {}: field 'tensor.name' '{}' appears twice", r.what(), name);
  }
  r.expect_end();
  return layout;
}

void validate_layout(const Layout& layout, const ModelInventory& inventory, std::string_view owner) {
  std::vector<Request> requests;
  LayoutResolver(inventory).resolve(layout, LayoutRole::kDestination, owner, requests);
}

LayoutSummary layout_bytes(const Layout& layout, const ModelInventory& inventory) {
  LayoutSummary s;
  for (const auto& t : inventory.tensors) {
    Selection sel = select(layout, t);
    if (sel.take == Take::kDrop) {
      ++s.dropped;
      continue;
    }
    ++s.tensors;
    if (sel.take == Take::kSlice) ++s.sliced;
    s.bytes += sel.info.nbytes();
  }
  return s;
}

void copy_slice(const std::byte* src, const TensorInfo& info, const Slice& slice, std::byte* dst) {
  if (auto problem = slice_problem(info, slice); !problem.empty())
    fail(ErrorKind::kLayout, "slice of tensor '{}': {}", info.name, problem);
  const Box box = Box::of(Request::narrow(slice.dim, slice.start, slice.length));
  pack_box(src, info.shape, dtype_size(info.dtype), box, 0, box.nbytes_in(info), dst);
}

}  // namespace refit
