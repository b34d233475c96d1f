#include "transport/local_socket/control_frame.h"

#include "core/fail.h"
#include "core/wire.h"

namespace refit::control_frame {

Bytes encode_header(FrameType type, uint8_t channel, size_t payload_bytes) {
  if (payload_bytes > kMaxPayloadBytes)
    fail(ErrorKind::kInvalidArgument, "a control frame of {} bytes exceeds the limit of {} bytes", payload_bytes,
         kMaxPayloadBytes);
  ByteWriter w;
  w.put<uint32_t>(static_cast<uint32_t>(payload_bytes + 2));
  w.put<uint8_t>(static_cast<uint8_t>(type));
  w.put<uint8_t>(channel);
  return w.take();
}

Bytes encode_hello(const EndpointId& sender, const EndpointId& target) {
  ByteWriter body;
  body.put_raw(kHelloMagic);
  body.put<uint8_t>(kVersion);
  body.put_raw(sender);
  body.put_raw(target);
  Bytes payload = body.take();
  Bytes frame = encode_header(FrameType::kHello, 0, payload.size());
  frame.insert(frame.end(), payload.begin(), payload.end());
  return frame;
}

Frame decode_frame(std::span<const uint8_t> stream, const std::string& from) {
  Frame frame;
  if (stream.size() < sizeof(uint32_t)) return frame;
  ByteReader r(stream, "control frame from " + from);
  const uint32_t length = r.get<uint32_t>("length");
  if (length < 2 || length > kMaxPayloadBytes + 2)
    fail(ErrorKind::kProtocol, "malformed {}: field 'length' is {} (expected 2 to {})", r.what(), length,
         kMaxPayloadBytes + 2);
  frame.bytes = sizeof(uint32_t) + size_t{length};
  if (r.remaining() < length) return frame;
  const uint8_t type = r.get<uint8_t>("type");
  if (type < static_cast<uint8_t>(FrameType::kHello) || type > static_cast<uint8_t>(FrameType::kBye))
    fail(ErrorKind::kProtocol, "malformed {}: field 'type' is {} (expected 1 = HELLO, 2 = DATA or 3 = BYE)", r.what(),
         type);
  frame.type = static_cast<FrameType>(type);
  frame.channel = r.get<uint8_t>("channel");
  frame.payload = r.get_raw(length - 2, "payload");
  frame.complete = true;
  return frame;
}

Hello decode_hello(const Frame& frame, const std::string& from) {
  ByteReader r(frame.payload, "HELLO from " + from);
  if (!frame.complete || frame.type != FrameType::kHello)
    fail(ErrorKind::kProtocol, "malformed {}: the connection did not start with a refit HELLO", r.what());
  if (frame.channel != 0)
    fail(ErrorKind::kProtocol, "malformed {}: field 'channel' is {} (a HELLO has channel 0)", r.what(), frame.channel);
  r.expect_magic(kHelloMagic);
  if (const auto version = r.get<uint8_t>("version"); version != kVersion)
    fail(ErrorKind::kProtocol, "malformed {}: field 'version' is {}, this build speaks {}", r.what(), version,
         kVersion);
  Hello hello;
  r.get_raw(hello.sender, "sender");
  r.get_raw(hello.target, "target");
  r.expect_end();
  return hello;
}

}  // namespace refit::control_frame
