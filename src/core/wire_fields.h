// A format's fields listed once, for both directions: a function template of the Io lists them in
// wire order, and is called with wire::Put to encode and wire::Get to decode, so that the encoder
// and the decoder cannot drift apart. A field with bounds (an enum, a flag, a number, a count) is
// checked as it is read, its error naming the field; checks across fields stay in the decoder.
//
//   template <typename Io, typename M>  // M: Message, const or not
//   void fields(Io& io, M& m) {
//     io(m.seq, "seq");
//     io(m.kind, "kind", Kind::kLast);
//     io.template items<uint64_t>(m.names, "name count", 8, [&](auto& name) { io(name, "name"); });
//   }
#pragma once

#include <algorithm>
#include <array>
#include <concepts>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "core/fail.h"
#include "core/wire.h"

namespace refit::wire {

template <typename T>
concept Enum = std::is_enum_v<T>;

// Writes each field as Get reads it.
struct Put {
  ByteWriter& w;
  // A number; bounds, if given, are the reader's.
  template <Scalar T>
  void operator()(const T& v, const char*, T = {}, T = {}) {
    w.put<T>(v);
  }
  // An enum, as one byte.
  template <Enum E>
  void operator()(const E& v, const char*, E) {
    w.put<uint8_t>(static_cast<uint8_t>(v));
  }
  void operator()(const bool& v, const char*) { w.put<uint8_t>(v ? 1 : 0); }
  void operator()(const std::string& v, const char*) { w.put_string(v); }
  // Bytes after their length (a fixed-size id too: the reader checks its size).
  void operator()(std::span<const uint8_t> v, const char*) { w.put_bytes(v); }
  // A flag, then the value (0 when there is none).
  void operator()(const std::optional<uint64_t>& v, const char* field) {
    (*this)(v.has_value(), field);
    w.put<uint64_t>(v.value_or(0));
  }
  // A count of type Count, then each item as `each` lists its fields.
  template <std::unsigned_integral Count, typename T, typename F>
  void items(const std::vector<T>& v, const char*, uint64_t, F&& each, uint64_t = UINT64_MAX) {
    w.put<Count>(static_cast<Count>(v.size()));
    for (const T& item : v) each(item);
  }
};

// Reads each field, refusing (Error kProtocol "malformed <what>: ...") a value out of its bounds.
struct Get {
  ByteReader& r;
  template <Scalar T>
  void operator()(T& v, const char* field) {
    v = r.get<T>(field);
  }
  template <Scalar T>
  void operator()(T& v, const char* field, T lo, T hi) {
    v = r.get<T>(field);
    if (v < lo || v > hi)
      fail(ErrorKind::kProtocol, "malformed {}: {} = {} (not in [{}, {}])", r.what(), field, v, lo, hi);
  }
  // An enum up to `last`.
  template <Enum E>
  void operator()(E& v, const char* field, E last) {
    const auto code = r.get<uint8_t>(field);
    if (code > static_cast<uint8_t>(last)) fail(ErrorKind::kProtocol, "malformed {}: {} = {}", r.what(), field, code);
    v = static_cast<E>(code);
  }
  void operator()(bool& v, const char* field) {
    uint8_t code = 0;
    (*this)(code, field, uint8_t{0}, uint8_t{1});
    v = code == 1;
  }
  void operator()(std::string& v, const char* field) { v = r.get_string(field); }
  void operator()(std::vector<uint8_t>& v, const char* field) {
    const auto bytes = r.get_bytes(field);
    v.assign(bytes.begin(), bytes.end());
  }
  template <size_t N>
  void operator()(std::array<uint8_t, N>& v, const char* field) {
    const auto bytes = r.get_bytes(field);
    if (bytes.size() != N)
      fail(ErrorKind::kProtocol, "malformed {}: {} of {} bytes, not {}", r.what(), field, bytes.size(), N);
    std::copy(bytes.begin(), bytes.end(), v.begin());
  }
  void operator()(std::optional<uint64_t>& v, const char* field) {
    bool present = false;
    (*this)(present, field);
    const auto value = r.get<uint64_t>(field);
    v = present ? std::optional(value) : std::nullopt;
  }
  // At most `max_count` items, of at least `min_item_bytes` each: a count the rest of the bytes
  // cannot hold is refused before anything is allocated.
  template <std::unsigned_integral Count, typename T, typename F>
  void items(std::vector<T>& v, const char* field, uint64_t min_item_bytes, F&& each, uint64_t max_count = UINT64_MAX) {
    const uint64_t n = r.get_count<Count>(field, min_item_bytes);
    if (n > max_count) fail(ErrorKind::kProtocol, "malformed {}: {} {} (at most {})", r.what(), field, n, max_count);
    v.resize(n);
    for (T& item : v) each(item);
  }
};

}  // namespace refit::wire
