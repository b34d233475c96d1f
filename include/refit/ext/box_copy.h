// Extension tier (refit/ext/: for backends, benches and bindings built on refit, not for its
// users' programs). Moving the bytes of a box (layout.h) between a row-major tensor and the box's packed form (its
// elements in row-major order, one after another): as strided 2-D blocks, which a CopyStream or
// plain memcpy carries out. A source packs a piece of its shard this way and a destination
// places a received piece into its tensor; a byte range of the packed form can be moved on its
// own, since pieces are cut into bucket-sized chunks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>

#include "refit/layout.h"

namespace refit {

struct BoxBlock {
  uint64_t tensor_offset = 0;  // bytes: the first row in the tensor
  uint64_t pitch = 0;          // bytes between the starts of consecutive rows in the tensor
  uint64_t packed_offset = 0;  // bytes: the first row in the packed box
  uint64_t row_bytes = 0;
  uint64_t rows = 0;
};

// Calls `fn` for the blocks that carry bytes [begin, begin + size) of the packed `box` of a
// tensor of `shape` with `element_bytes`-byte elements, in packed order. The box must fit the
// shape and the range the box's bytes (the caller validated both).
void for_each_box_block(std::span<const int64_t> shape, uint64_t element_bytes, const Box& box, uint64_t begin,
                        uint64_t size, const std::function<void(const BoxBlock&)>& fn);

// Host-memory forms: packed bytes [begin, begin + size) of `box` out of `tensor` into `packed`
// (which points at byte `begin` of the packed box), and back.
void pack_box(const std::byte* tensor, std::span<const int64_t> shape, uint64_t element_bytes, const Box& box,
              uint64_t begin, uint64_t size, std::byte* packed);
void unpack_box(const std::byte* packed, std::span<const int64_t> shape, uint64_t element_bytes, const Box& box,
                uint64_t begin, uint64_t size, std::byte* tensor);

}  // namespace refit
