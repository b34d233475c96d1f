// The header of a safetensors file, decoded from the file's bytes: an 8-byte little-endian header
// length (read with the wire codec, core/wire.h), then that many bytes of JSON
// {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the data.
// A pure function over bytes, so that tests and the fuzz target fuzz/fuzz_safetensors.cpp reach it
// without a file.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "refit/tensor.h"

namespace refit {

struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;  // in file order (by data offset)
  std::vector<uint64_t> offsets;    // absolute file offset of each tensor's data
};

// Checks that the header fits the file, is a JSON object of known dtypes and shapes whose
// dtype x shape fits 64 bits, and that every tensor's data lies inside the file, matches its size
// and overlaps no other. Throws Error(kModel) "safetensors '<path>': ..." naming the tensor.
SafetensorsHeader decode_safetensors_header(std::span<const uint8_t> file, const std::string& path);

}  // namespace refit
