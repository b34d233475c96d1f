#include "refit/ext/box_copy.h"

#include <cstring>
#include <vector>

namespace refit {

void for_each_box_block(std::span<const int64_t> shape, uint64_t element_bytes, const Box& box, uint64_t begin,
                        uint64_t size, const std::function<void(const BoxBlock&)>& fn) {
  if (size == 0) return;
  const size_t rank = shape.size();
  const std::vector<int64_t> extent = box.shape_in(shape);
  std::vector<uint64_t> stride(rank + 1, element_bytes);  // stride[d]: bytes per step along d
  for (size_t d = rank; d-- > 0;)
    stride[d] = d + 1 < rank ? stride[d + 1] * static_cast<uint64_t>(shape[d + 1]) : element_bytes;
  // The innermost dim the box does not span whole: its rows of `run` bytes are contiguous in the
  // tensor, and consecutive rows along the dim before it are `pitch` apart.
  int inner = -1;
  for (size_t d = 0; d < rank; ++d)
    if (extent[d] != shape[d]) inner = static_cast<int>(d);
  if (inner < 0) {  // the whole tensor: packed and tensor bytes coincide
    fn({begin, size, begin, size, 1});
    return;
  }
  uint64_t base = 0;
  for (int i = 0; i < box.count; ++i) base += static_cast<uint64_t>(box.cuts[i].start) * stride[box.cuts[i].dim];
  const uint64_t run = static_cast<uint64_t>(extent[inner]) * stride[inner];
  const uint64_t group = inner >= 1 ? static_cast<uint64_t>(extent[inner - 1]) : 1;
  const uint64_t pitch = inner >= 1 ? stride[inner - 1] : run;
  auto run_offset = [&](uint64_t r) {
    uint64_t offset = base;
    for (int d = inner - 1; d >= 0; --d) {
      offset += (r % static_cast<uint64_t>(extent[d])) * stride[d];
      r /= static_cast<uint64_t>(extent[d]);
    }
    return offset;
  };
  const uint64_t end = begin + size;
  for (uint64_t pos = begin; pos < end;) {
    const uint64_t r = pos / run, within = pos % run;
    if (within != 0 || end - pos < run) {  // part of one row
      const uint64_t n = std::min(run - within, end - pos);
      fn({run_offset(r) + within, n, pos, n, 1});
      pos += n;
      continue;
    }
    const uint64_t rows = std::min(group - r % group, (end - pos) / run);
    fn({run_offset(r), pitch, pos, run, rows});
    pos += rows * run;
  }
}

void pack_box(const std::byte* tensor, std::span<const int64_t> shape, uint64_t element_bytes, const Box& box,
              uint64_t begin, uint64_t size, std::byte* packed) {
  for_each_box_block(shape, element_bytes, box, begin, size, [&](const BoxBlock& b) {
    for (uint64_t i = 0; i < b.rows; ++i)
      std::memcpy(packed + (b.packed_offset - begin) + i * b.row_bytes, tensor + b.tensor_offset + i * b.pitch,
                  b.row_bytes);
  });
}

void unpack_box(const std::byte* packed, std::span<const int64_t> shape, uint64_t element_bytes, const Box& box,
                uint64_t begin, uint64_t size, std::byte* tensor) {
  for_each_box_block(shape, element_bytes, box, begin, size, [&](const BoxBlock& b) {
    for (uint64_t i = 0; i < b.rows; ++i)
      std::memcpy(tensor + b.tensor_offset + i * b.pitch, packed + (b.packed_offset - begin) + i * b.row_bytes,
                  b.row_bytes);
  });
}

}  // namespace refit
