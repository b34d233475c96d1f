// The frames of the local control socket (the format is in local_socket.h), encoded and decoded
// with the wire codec (core/wire.h). Pure functions over bytes, so that tests and the fuzz target
// fuzz/fuzz_local_frame.cpp reach them without a socket.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "refit/ext/transport.h"
#include "transport/local_socket/local_socket.h"

namespace refit::control_frame {

inline constexpr std::string_view kHelloMagic = "RFLS";
inline constexpr uint8_t kVersion = 1;
enum class FrameType : uint8_t { kHello = 1, kData = 2, kBye = 3 };
// u32 length (of what follows it), u8 type, u8 channel.
inline constexpr size_t kHeaderBytes = 6;
inline constexpr uint32_t kMaxPayloadBytes = LocalSocketEndpoint::kMaxMessageBytes;

// The header of a frame whose payload of `payload_bytes` follows it. Throws
// Error(kInvalidArgument) above kMaxPayloadBytes.
Bytes encode_header(FrameType type, uint8_t channel, size_t payload_bytes);
// A whole HELLO frame: the first on a connection, from `sender` to the endpoint `target`.
Bytes encode_hello(const EndpointId& sender, const EndpointId& target);

struct Frame {
  // The whole frame's size, header included; 0 while not even its length has arrived.
  size_t bytes = 0;
  bool complete = false;  // all `bytes` are there: the fields below are set
  FrameType type = FrameType::kData;
  uint8_t channel = 0;
  std::span<const uint8_t> payload;  // inside the stream given to decode_frame
};

// The frame at the start of `stream` (what a connection delivered, from a frame boundary on).
// Throws Error(kProtocol) "malformed control frame from <from>: ..." for a length below the
// header's 2 bytes or above kMaxPayloadBytes + 2 (as soon as the length has arrived) and for an
// unknown type.
Frame decode_frame(std::span<const uint8_t> stream, const std::string& from);

struct Hello {
  EndpointId sender{};
  EndpointId target{};
};
// A HELLO frame (channel 0) and its payload: magic, version, sender, target, nothing more.
// Throws Error(kProtocol) naming `from` otherwise, and for a frame that is not a HELLO.
Hello decode_hello(const Frame& frame, const std::string& from);

}  // namespace refit::control_frame
