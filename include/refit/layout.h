// Destination layouts: what a destination holds of each source tensor, and therefore what a
// source sends it. For every source tensor a layout says one of
//   whole             send the tensor as it is;
//   narrow(dim, s, n) send rows [s, s+n) of dimension `dim` (row-major, made contiguous);
//   drop              send nothing.
// Lookup order for a name: its own entry; else dropped if it starts with one of
// `drop_prefixes` (plain prefix match, so prefixes end with '.': "model.layers.1." never
// matches "model.layers.10."); else `fallback`. Names outside the inventory (KV-cache scales,
// draft weights) reach the source too and get the same rules.
//
// A destination builds its layout (layout_builders.h), encodes it into its metadata; the source
// decodes it, validates it against its inventory, and applies `select` while packing (its copies
// are the engine's box copies; `copy_slice` below makes the same bytes, for callers that check
// a slice). Plain data: safe to share between threads once built.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "refit/model.h"
#include "refit/tensor.h"

namespace refit {

struct Slice {
  int32_t dim = 0;
  int64_t start = 0;
  int64_t length = 0;
  bool operator==(const Slice&) const = default;
};

enum class Take : uint8_t { kWhole = 0, kSlice = 1, kDrop = 2 };

std::string_view to_string(Take take);

// What a destination wants of one tensor.
struct Request {
  Take take = Take::kWhole;
  Slice slice;  // only for kSlice

  static Request whole() { return {}; }
  static Request drop() { return {Take::kDrop, {}}; }
  static Request narrow(int32_t dim, int64_t start, int64_t length) { return {Take::kSlice, {dim, start, length}}; }
  bool operator==(const Request&) const = default;
};

// A block of a tensor: the tensor narrowed along at most two distinct dimensions, which is what
// one layout's slice intersected with another's can be (a source's shard of dim 0 and a
// destination's slice of dim 1). Cuts are kept in ascending dim order.
struct Box {
  static constexpr int kMaxCuts = 2;
  std::array<Slice, kMaxCuts> cuts{};
  uint8_t count = 0;

  static Box whole() { return {}; }
  // The block a request names (whole for kWhole; kDrop has none).
  static Box of(const Request& request);
  // This box narrowed further by `slice` (the intersection; possibly empty). Throws
  // Error(kLayout) when that would need a third cut.
  Box narrowed(const Slice& slice) const;
  // The range this box covers along `dim` of a tensor of `shape`.
  Slice along(int32_t dim, std::span<const int64_t> shape) const;
  // The box's shape within a tensor of `shape`, and its bytes within `tensor`.
  std::vector<int64_t> shape_in(std::span<const int64_t> shape) const;
  uint64_t nbytes_in(const TensorInfo& tensor) const;
  // The same block in the coordinates of `origin`, a slice of the tensor that contains it.
  Box relative_to(const Slice& origin) const;
  bool is_whole() const { return count == 0; }
  bool operator==(const Box&) const = default;
};

// "whole", "dim 0 [0, 64)", "dim 0 [0, 64) x dim 1 [128, 256)".
std::string to_string(const Box& box);

struct Layout {
  std::map<std::string, Request, std::less<>> tensors;  // by source tensor name
  std::vector<std::string> drop_prefixes;               // e.g. pipeline stages this destination lacks
  Take fallback = Take::kWhole;                         // kWhole or kDrop

  // The rule for `name` (its entry, a dropped prefix, or the fallback).
  Request request_for(std::string_view name) const;
  bool operator==(const Layout&) const = default;
};

// What the source sends for one tensor. `info` has the source's name and dtype and the shape
// that is sent; for kDrop it is the source's info unchanged (nothing is sent). A slice that
// covers its whole dimension is reported as kWhole, so the source sends it without a copy.
struct Selection {
  Take take = Take::kWhole;
  Slice slice;
  TensorInfo info;
};

// Throws Error(kLayout) if the tensor's entry does not fit its shape (validate_layout catches
// this earlier for inventory tensors).
Selection select(const Layout& layout, const TensorInfo& source);

// Byte encoding for destination metadata. decode_layout rejects malformed input with
// Error(kProtocol) naming `what` and the field; it never reads out of bounds and bounds every
// count by the bytes present.
std::vector<uint8_t> encode_layout(const Layout& layout);
Layout decode_layout(std::span<const uint8_t> bytes, std::string_view what = "layout");

// Checks a destination's layout against the model's inventory: every listed name exists, slice
// dims and bounds fit, no listed tensor is also under a dropped prefix, prefixes are non-empty
// and end with '.', every FP8 scale is asked for as its weight's slice needs (fp8.h). Throws Error(kLayout) naming the
// tensor and `owner` ("destination rank 3").
void validate_layout(const Layout& layout, const ModelInventory& inventory, std::string_view owner);

struct LayoutSummary {
  uint64_t tensors = 0;  // tensors sent (whole or sliced)
  uint64_t sliced = 0;   // of which sliced
  uint64_t dropped = 0;
  uint64_t bytes = 0;  // bytes sent
};
LayoutSummary layout_bytes(const Layout& layout, const ModelInventory& inventory);

// Row-major narrow of the contiguous host tensor at `src` (described by `info`) into the
// contiguous buffer `dst` (the slice's bytes), with the engine's box copies. Throws
// Error(kLayout) for a slice that does not fit `info`.
void copy_slice(const std::byte* src, const TensorInfo& info, const Slice& slice, std::byte* dst);

}  // namespace refit
