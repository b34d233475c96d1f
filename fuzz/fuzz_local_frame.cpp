// The local control socket's frames (src/transport/local_socket/control_frame.cpp) on arbitrary
// bytes, as LocalSocketEndpoint's thread reads what an accepted connection delivered: frames one
// after another, the first a HELLO, then DATA and BYE.
// Oracles: only Error(kProtocol) naming the sender may come out; an incomplete frame announces a
// size beyond the bytes present; a complete frame lies inside the stream and re-encodes to
// exactly its bytes; an accepted HELLO re-encodes to its frame.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "fuzz_common.h"
#include "transport/local_socket/control_frame.h"

using namespace refit;
using namespace refit::control_frame;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> stream(data, size);
  size_t consumed = 0;
  bool introduced = false;
  try {
    while (true) {
      const Frame frame = decode_frame(stream.subspan(consumed), "a new connection");
      if (!frame.complete) {
        FUZZ_CHECK(frame.bytes == 0 ? size - consumed < 4 : frame.bytes > size - consumed);
        FUZZ_CHECK(frame.bytes <= kHeaderBytes + kMaxPayloadBytes);
        break;
      }
      FUZZ_CHECK(frame.bytes >= kHeaderBytes && frame.bytes <= size - consumed);
      FUZZ_CHECK(frame.payload.size() == frame.bytes - kHeaderBytes);
      FUZZ_CHECK(frame.payload.data() == data + consumed + kHeaderBytes);
      Bytes again = encode_header(frame.type, frame.channel, frame.payload.size());
      again.insert(again.end(), frame.payload.begin(), frame.payload.end());
      FUZZ_CHECK(again.size() == frame.bytes);
      FUZZ_CHECK(std::equal(again.begin(), again.end(), data + consumed));
      if (!introduced) {
        const Hello hello = decode_hello(frame, "a new connection");
        const Bytes hello_again = encode_hello(hello.sender, hello.target);
        FUZZ_CHECK(hello_again == again);
        introduced = true;
      } else {
        FUZZ_CHECK(frame.type == FrameType::kHello || frame.type == FrameType::kData || frame.type == FrameType::kBye);
      }
      consumed += frame.bytes;
    }
  } catch (const Error& e) {
    FUZZ_EXPECT_ERROR(e, ErrorKind::kProtocol, "a new connection");
  }
  return 0;
}
