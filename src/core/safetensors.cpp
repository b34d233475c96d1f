#include "refit/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>
#include <utility>

#include "core/fail.h"
#include "core/safetensors_header.h"
#include "core/wire.h"

namespace refit {
namespace {

// The reference implementation refuses headers above 100 MB; so do we, before allocating.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// Only the safetensors spellings are valid in a file header ("BF16", not "bfloat16").
bool safetensors_dtype(std::string_view name, DType* out) {
  for (int i = 0; i < kDTypeCount; ++i) {
    auto dtype = static_cast<DType>(i);
    if (dtype_safetensors_name(dtype) == name) {
      *out = dtype;
      return true;
    }
  }
  return false;
}

bool is_uint(const nlohmann::json& j) {
  return j.is_number_unsigned() || (j.is_number_integer() && j.get<int64_t>() >= 0);
}

struct Entry {
  TensorInfo info;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// Parses and checks one header entry; `data_size` is the number of bytes after the header.
Entry parse_entry(const std::string& path, const std::string& name, const nlohmann::json& v, uint64_t data_size) {
  if (!v.is_object()) fail(ErrorKind::kModel, "safetensors '{}': tensor '{}': entry is not an object", path, name);
  auto dtype_it = v.find("dtype");
  auto shape_it = v.find("shape");
  auto offsets_it = v.find("data_offsets");
  if (dtype_it == v.end() || !dtype_it->is_string())
    fail(ErrorKind::kModel, "safetensors '{}': tensor '{}': missing or non-string 'dtype'", path, name);
  if (shape_it == v.end() || !shape_it->is_array())
    fail(ErrorKind::kModel, "safetensors '{}': tensor '{}': missing or non-array 'shape'", path, name);
  if (offsets_it == v.end() || !offsets_it->is_array() || offsets_it->size() != 2 || !is_uint((*offsets_it)[0]) ||
      !is_uint((*offsets_it)[1]))
    fail(ErrorKind::kModel, "safetensors '{}': tensor '{}': 'data_offsets' must be two non-negative integers", path,
         name);

  Entry e;
  e.info.name = name;
  auto dtype_name = dtype_it->get<std::string>();
  if (!safetensors_dtype(dtype_name, &e.info.dtype))
    fail(ErrorKind::kModel, "safetensors '{}': tensor '{}': unknown dtype '{}'", path, name, dtype_name);
  // dtype x shape must fit 64 bits, so that nbytes() is exact.
  uint64_t nbytes = dtype_size(e.info.dtype);
  for (const auto& d : *shape_it) {
    if (!is_uint(d) || d.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
      fail(ErrorKind::kModel, "safetensors '{}': tensor '{}': bad shape: dimension {} is not an integer in [0, 2^63)",
           path, name, e.info.shape.size());
    const auto dim = d.get<uint64_t>();
    if (dim != 0 && nbytes > UINT64_MAX / dim)
      fail(ErrorKind::kModel, "safetensors '{}': tensor '{}': shape {}... of {} holds more than 2^64 bytes", path, name,
           shape_string(e.info.shape), dtype_name);
    nbytes *= dim;
    e.info.shape.push_back(static_cast<int64_t>(dim));
  }
  e.begin = (*offsets_it)[0].get<uint64_t>();
  e.end = (*offsets_it)[1].get<uint64_t>();
  if (e.end < e.begin)
    fail(ErrorKind::kModel, "safetensors '{}': tensor '{}': data_offsets [{}, {}] end before begin", path, name,
         e.begin, e.end);
  if (e.end - e.begin != e.info.nbytes())
    fail(ErrorKind::kModel, "safetensors '{}': tensor '{}': data_offsets [{}, {}] hold {} bytes but {} {} needs {}",
         path, name, e.begin, e.end, e.end - e.begin, dtype_name, shape_string(e.info.shape), e.info.nbytes());
  if (e.end > data_size)
    fail(ErrorKind::kModel,
         "safetensors '{}': tensor '{}': data_offsets [{}, {}] run past the end of the data ({} bytes)", path, name,
         e.begin, e.end, data_size);
  return e;
}

}  // namespace

SafetensorsHeader decode_safetensors_header(std::span<const uint8_t> file, const std::string& path) {
  const uint64_t file_size = file.size();
  ByteReader r(file, fmt::format("safetensors '{}'", path));
  if (file_size < 8)
    fail(ErrorKind::kModel, "safetensors '{}': file is {} bytes, shorter than the 8-byte header length", path,
         file_size);
  const auto header_len = r.get<uint64_t>("header length");
  if (header_len > kMaxHeaderBytes || header_len > r.remaining())
    fail(ErrorKind::kModel, "safetensors '{}': header length {} runs past the end of the file ({} bytes)", path,
         header_len, file_size);
  const auto header = r.get_raw(header_len, "header");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header.begin(), header.end());
  } catch (const nlohmann::json::exception& e) {
    fail(ErrorKind::kModel, "safetensors '{}': header is not valid JSON: {}", path, e.what());
  }
  if (!j.is_object()) fail(ErrorKind::kModel, "safetensors '{}': header is not a JSON object", path);

  const uint64_t data_start = r.position();
  const uint64_t data_size = r.remaining();
  std::vector<Entry> entries;
  for (const auto& [name, v] : j.items()) {
    if (name == "__metadata__") continue;
    entries.push_back(parse_entry(path, name, v, data_size));
  }
  std::stable_sort(entries.begin(), entries.end(),
                   [](const Entry& a, const Entry& b) { return std::tie(a.begin, a.end) < std::tie(b.begin, b.end); });
  // Zero-size tensors occupy no bytes, so they cannot overlap anything.
  const Entry* prev = nullptr;
  for (const auto& e : entries) {
    if (e.begin == e.end) continue;
    if (prev && e.begin < prev->end)
      fail(ErrorKind::kModel, "safetensors '{}': tensor '{}' [{}, {}] overlaps tensor '{}' [{}, {}]", path, e.info.name,
           e.begin, e.end, prev->info.name, prev->begin, prev->end);
    prev = &e;
  }
  SafetensorsHeader out;
  for (auto& e : entries) {
    out.offsets.push_back(data_start + e.begin);
    out.tensors.push_back(std::move(e.info));
  }
  return out;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(ErrorKind::kModel, "safetensors '{}': cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    fail(ErrorKind::kModel, "safetensors '{}': cannot stat: {}", path, std::strerror(err));
  }
  auto file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    ::close(fd);
    fail(ErrorKind::kModel, "safetensors '{}': file is {} bytes, shorter than the 8-byte header length", path,
         file_size);
  }
  void* map = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  int map_err = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (map == MAP_FAILED) fail(ErrorKind::kModel, "safetensors '{}': mmap failed: {}", path, std::strerror(map_err));
  map_ = static_cast<const std::byte*>(map);
  map_size_ = file_size;

  try {
    SafetensorsHeader header =
        decode_safetensors_header({reinterpret_cast<const uint8_t*>(map_), static_cast<size_t>(file_size)}, path);
    tensors_ = std::move(header.tensors);
    offsets_.assign(header.offsets.begin(), header.offsets.end());
  } catch (...) {
    unmap();
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() { unmap(); }

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept { *this = std::move(other); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    unmap();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_size_ = std::exchange(other.map_size_, 0);
    tensors_ = std::move(other.tensors_);
    offsets_ = std::move(other.offsets_);
  }
  return *this;
}

void SafetensorsFile::unmap() noexcept {
  if (map_) ::munmap(const_cast<std::byte*>(map_), map_size_);
  map_ = nullptr;
  map_size_ = 0;
}

std::span<const std::byte> SafetensorsFile::data(size_t index) const {
  if (index >= tensors_.size())
    fail(ErrorKind::kInvalidArgument, "safetensors '{}': tensor index {} out of range ({} tensors)", path_, index,
         tensors_.size());
  return {map_ + offsets_[index], static_cast<size_t>(tensors_[index].nbytes())};
}

void write_safetensors(const std::string& path, std::span<const SafetensorsEntry> entries) {
  // ordered_json keeps the entries in the caller's order; data follows in the same order.
  nlohmann::ordered_json header;
  header["__metadata__"] = {{"format", "pt"}};
  std::set<std::string_view> names;
  uint64_t offset = 0;
  for (const auto& e : entries) {
    if (e.info.name == "__metadata__" || !names.insert(e.info.name).second)
      fail(ErrorKind::kInvalidArgument, "safetensors '{}': tensor name '{}' is repeated or reserved", path,
           e.info.name);
    uint64_t nbytes = e.info.nbytes();
    if (e.data.size() != nbytes)
      fail(ErrorKind::kInvalidArgument, "safetensors '{}': tensor '{}' {} {} needs {} bytes but {} were given", path,
           e.info.name, dtype_name(e.info.dtype), shape_string(e.info.shape), nbytes, e.data.size());
    header[e.info.name] = {{"dtype", dtype_safetensors_name(e.info.dtype)},
                           {"shape", e.info.shape},
                           {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  // Like the reference writer: pad the header with spaces so that the data starts 8-aligned.
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  ByteWriter length;
  length.put<uint64_t>(text.size());
  const std::vector<uint8_t> header_len = length.take();

  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) fail(ErrorKind::kIo, "safetensors '{}': cannot create: {}", path, std::strerror(errno));
  bool ok = std::fwrite(header_len.data(), 1, header_len.size(), f) == header_len.size() &&
            std::fwrite(text.data(), 1, text.size(), f) == text.size();
  for (const auto& e : entries) {
    if (!ok) break;
    ok = e.data.empty() || std::fwrite(e.data.data(), 1, e.data.size(), f) == e.data.size();
  }
  int err = ok ? 0 : errno;
  if (std::fclose(f) != 0 && ok) {
    ok = false;
    err = errno;
  }
  if (!ok) {
    std::remove(path.c_str());
    fail(ErrorKind::kIo, "safetensors '{}': write failed: {}", path, std::strerror(err));
  }
}

}  // namespace refit
