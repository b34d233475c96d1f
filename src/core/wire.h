// The one byte codec of refit's wire formats (engine metadata and messages, layouts, the
// driver-worker channel's frame length, the local control socket's frames, backend addresses
// and region keys, the safetensors header length). Every integer is little-endian whatever the
// host; a float or double travels as the bits of the unsigned integer of its size; byte strings
// travel as they are, with or without a length before them. Nothing is copied as a raw struct.
//
// The reader checks every length against what is left, so a truncated or garbled message becomes
// Error(kProtocol) "malformed <what>: ..." naming what was decoded and the field, never an
// out-of-bounds read; get_count() refuses counts the remaining bytes cannot hold before anything
// is allocated for them.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "core/fail.h"

namespace refit {

namespace wire {

static_assert(std::endian::native == std::endian::little || std::endian::native == std::endian::big,
              "refit's wire codec supports little- and big-endian hosts");

// What put() and get() carry: integers (not bool: a flag is a u8 the decoder checks) and
// IEEE-754 floats of 4 or 8 bytes.
template <typename T>
concept Scalar = (std::integral<T> && !std::same_as<T, bool>) ||
                 (std::floating_point<T> && std::numeric_limits<T>::is_iec559 && (sizeof(T) == 4 || sizeof(T) == 8));

template <size_t N>
struct UnsignedOfSize;
template <>
struct UnsignedOfSize<1> {
  using type = uint8_t;
};
template <>
struct UnsignedOfSize<2> {
  using type = uint16_t;
};
template <>
struct UnsignedOfSize<4> {
  using type = uint32_t;
};
template <>
struct UnsignedOfSize<8> {
  using type = uint64_t;
};
// The unsigned integer a value of T travels as.
template <Scalar T>
using Bits = typename UnsignedOfSize<sizeof(T)>::type;

template <std::unsigned_integral U>
constexpr U byteswap(U v) {
  U out = 0;
  for (size_t i = 0; i < sizeof(U); ++i) {
    out = static_cast<U>((static_cast<uint64_t>(out) << 8) | (v & 0xff));
    v = static_cast<U>(static_cast<uint64_t>(v) >> 8);
  }
  return out;
}

// Host order <-> little-endian (its own inverse).
template <std::unsigned_integral U>
constexpr U little_endian(U v) {
  if constexpr (std::endian::native == std::endian::big) {
    return byteswap(v);
  } else {
    return v;
  }
}

// The little-endian bytes of `value`, and back.
template <Scalar T>
constexpr std::array<uint8_t, sizeof(T)> encode(T value) {
  return std::bit_cast<std::array<uint8_t, sizeof(T)>>(little_endian(std::bit_cast<Bits<T>>(value)));
}
template <Scalar T>
constexpr T decode(std::span<const uint8_t, sizeof(T)> bytes) {
  std::array<uint8_t, sizeof(T)> copy{};
  for (size_t i = 0; i < sizeof(T); ++i) copy[i] = bytes[i];
  return std::bit_cast<T>(little_endian(std::bit_cast<Bits<T>>(copy)));
}

inline std::span<const uint8_t> as_bytes(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

}  // namespace wire

class ByteWriter {
 public:
  template <wire::Scalar T>
  void put(T value) {
    for (uint8_t byte : wire::encode(value)) out_.push_back(byte);
  }
  // Bytes as they are, no length before them: magics, fixed-size ids and handles.
  void put_raw(std::span<const uint8_t> bytes) { out_.insert(out_.end(), bytes.begin(), bytes.end()); }
  void put_raw(std::string_view s) { put_raw(wire::as_bytes(s)); }
  // A length of type Length, then the bytes. Throws Error(kInvalidArgument) when the size does not
  // fit a Length.
  template <std::unsigned_integral Length = uint64_t>
  void put_bytes(std::span<const uint8_t> bytes) {
    if (bytes.size() > std::numeric_limits<Length>::max())
      fail(ErrorKind::kInvalidArgument, "cannot encode {} bytes behind a {}-byte length", bytes.size(), sizeof(Length));
    put<Length>(static_cast<Length>(bytes.size()));
    put_raw(bytes);
  }
  template <std::unsigned_integral Length = uint64_t>
  void put_string(std::string_view s) {
    put_bytes<Length>(wire::as_bytes(s));
  }
  size_t size() const { return out_.size(); }
  std::vector<uint8_t> take() { return std::move(out_); }

 private:
  std::vector<uint8_t> out_;
};

class ByteReader {
 public:
  // `what` names the bytes in errors, e.g. "message from source rank 2".
  ByteReader(std::span<const uint8_t> in, std::string what) : in_(in), what_(std::move(what)) {}

  template <wire::Scalar T>
  T get(const char* field) {
    return wire::decode<T>(take(sizeof(T), field).template first<sizeof(T)>());
  }
  // `n` bytes as they are.
  std::span<const uint8_t> get_raw(uint64_t n, const char* field) { return take(n, field); }
  // Fills a fixed-size id or handle.
  template <size_t N>
  void get_raw(std::array<uint8_t, N>& out, const char* field) {
    auto bytes = take(N, field);
    std::copy(bytes.begin(), bytes.end(), out.begin());
  }
  template <std::unsigned_integral Length = uint64_t>
  std::span<const uint8_t> get_bytes(const char* field) {
    return take(get<Length>(field), field);
  }
  template <std::unsigned_integral Length = uint64_t>
  std::string get_string(const char* field) {
    auto s = get_bytes<Length>(field);
    return {reinterpret_cast<const char*>(s.data()), s.size()};
  }
  // The magic that starts a format: Error(kProtocol) "malformed <what>: it does not start with
  // '<magic>'" otherwise.
  void expect_magic(std::string_view magic) {
    if (remaining() < magic.size() || !std::equal(magic.begin(), magic.end(), in_.begin() + pos_))
      fail(ErrorKind::kProtocol, "malformed {}: it does not start with the magic '{}'", what_, magic);
    pos_ += magic.size();
  }
  // A count of items that each take at least `min_item_bytes`: rejects counts the remaining
  // bytes cannot hold before anything is allocated for them.
  template <std::unsigned_integral Count = uint64_t>
  uint64_t get_count(const char* field, uint64_t min_item_bytes) {
    uint64_t n = get<Count>(field);
    if (min_item_bytes > 0 && n > remaining() / min_item_bytes)
      fail(ErrorKind::kProtocol, "malformed {}: {} count {} exceeds the message size", what_, field, n);
    return n;
  }
  void expect_end() const {
    if (pos_ != in_.size()) fail(ErrorKind::kProtocol, "malformed {}: {} trailing bytes", what_, in_.size() - pos_);
  }
  uint64_t remaining() const { return in_.size() - pos_; }
  uint64_t position() const { return pos_; }
  const std::string& what() const { return what_; }

 private:
  std::span<const uint8_t> take(uint64_t n, const char* field) {
    if (n > remaining())
      fail(ErrorKind::kProtocol, "malformed {}: truncated at field '{}' (needs {} bytes, {} left)", what_, field, n,
           remaining());
    auto s = in_.subspan(pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return s;
  }
  std::span<const uint8_t> in_;
  size_t pos_ = 0;
  std::string what_;
};

}  // namespace refit
