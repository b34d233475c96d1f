// The frames of the driver-worker channel (channel.h): a u64 body length (little-endian, with the
// wire codec of core/wire.h), then the body: a JSON value as CBOR (u64 length, bytes), then its
// binary values of 1 KiB or more as they are (u64 count; each a u64 length and bytes), each
// standing in the CBOR as {"refit:raw": its index}, since nlohmann's reader copies binary values a
// byte at a time. Pure functions over bytes, so that tests and the fuzz target
// fuzz/fuzz_channel.cpp reach the decoders without a socket.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace refit::channel_frame {

inline constexpr size_t kLengthBytes = 8;
// Larger frames are refused before anything is allocated: metadata of thousands of workers fits.
inline constexpr uint64_t kMaxBodyBytes = 1ull << 30;
// nlohmann's CBOR reader recurses per nesting level; deeper input is refused before parsing.
inline constexpr int kMaxDepth = 64;

// A whole frame: length, then body.
std::vector<uint8_t> encode(const nlohmann::json& message);
// The body length from a frame's first kLengthBytes. Throws Error(kProtocol) "malformed channel
// frame from <peer>: ..." for a length above kMaxBodyBytes.
uint64_t decode_length(std::span<const uint8_t, kLengthBytes> header, const std::string& peer);
// A frame's body. Throws Error(kProtocol) naming the channel message from <peer> for a body that
// is not as above, CBOR that is not one value or is nested deeper than kMaxDepth, or a raw index
// out of range.
nlohmann::json decode_body(std::span<const uint8_t> body, const std::string& peer);

}  // namespace refit::channel_frame
