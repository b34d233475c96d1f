// Little-endian byte encoding for metadata and control messages. The reader checks every
// length against what is left, so a truncated or garbled message becomes Error(kProtocol)
// naming what was being decoded, never an out-of-bounds read.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/fail.h"

namespace refit {

class ByteWriter {
 public:
  template <typename T>
  void put(T value) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const uint8_t*>(&value);
    out_.insert(out_.end(), p, p + sizeof(T));
  }
  void put_bytes(std::span<const uint8_t> bytes) {
    put<uint64_t>(bytes.size());
    out_.insert(out_.end(), bytes.begin(), bytes.end());
  }
  void put_string(std::string_view s) { put_bytes({reinterpret_cast<const uint8_t*>(s.data()), s.size()}); }
  std::vector<uint8_t> take() { return std::move(out_); }

 private:
  std::vector<uint8_t> out_;
};

class ByteReader {
 public:
  // `what` names the message in errors, e.g. "bucket message from source rank 2".
  ByteReader(std::span<const uint8_t> in, std::string what) : in_(in), what_(std::move(what)) {}

  template <typename T>
  T get(const char* field) {
    static_assert(std::is_trivially_copyable_v<T>);
    need(sizeof(T), field);
    T value;
    std::memcpy(&value, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }
  std::span<const uint8_t> get_bytes(const char* field) {
    uint64_t n = get<uint64_t>(field);
    need(n, field);
    auto s = in_.subspan(pos_, n);
    pos_ += n;
    return s;
  }
  std::string get_string(const char* field) {
    auto s = get_bytes(field);
    return {reinterpret_cast<const char*>(s.data()), s.size()};
  }
  // A count of items that each take at least `min_item_bytes`: rejects counts the remaining
  // bytes cannot hold before anything is allocated for them.
  uint64_t get_count(const char* field, uint64_t min_item_bytes) {
    uint64_t n = get<uint64_t>(field);
    if (min_item_bytes > 0 && n > remaining() / min_item_bytes)
      fail(ErrorKind::kProtocol, "malformed {}: {} count {} exceeds the message size", what_, field, n);
    return n;
  }
  void expect_end() const {
    if (pos_ != in_.size()) fail(ErrorKind::kProtocol, "malformed {}: {} trailing bytes", what_, in_.size() - pos_);
  }
  uint64_t remaining() const { return in_.size() - pos_; }
  const std::string& what() const { return what_; }

 private:
  void need(uint64_t n, const char* field) const {
    if (n > in_.size() - pos_)
      fail(ErrorKind::kProtocol, "malformed {}: truncated at field '{}' (needs {} bytes, {} left)", what_, field, n,
           in_.size() - pos_);
  }
  std::span<const uint8_t> in_;
  size_t pos_ = 0;
  std::string what_;
};

}  // namespace refit
