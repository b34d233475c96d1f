// safetensors files: a reader that maps the file and hands out views of its tensors, and a
// writer (used for fixtures and tools). Format: 8-byte little-endian header length, a JSON
// header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then data.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "refit/tensor.h"

namespace refit {

class SafetensorsFile {
 public:
  // Maps the file read-only and validates the header: offsets inside the file, sizes matching
  // dtype x shape, no overlaps. Throws Error(kModel) naming the file and tensor.
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // In file order (by data offset).
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // The bytes of tensor `index` of tensors(); valid while this object lives.
  std::span<const std::byte> data(size_t index) const;

 private:
  void unmap() noexcept;
  std::string path_;
  const std::byte* map_ = nullptr;
  size_t map_size_ = 0;
  std::vector<TensorInfo> tensors_;
  std::vector<size_t> offsets_;  // absolute file offsets of each tensor's data
};

struct SafetensorsEntry {
  TensorInfo info;
  std::span<const std::byte> data;  // must be exactly info.nbytes()
};

// Writes a safetensors file. Throws Error(kIo) or Error(kInvalidArgument) for a size mismatch
// or a repeated name.
void write_safetensors(const std::string& path, std::span<const SafetensorsEntry> entries);

}  // namespace refit
