// The local driver <-> worker channel (src/sync/channel.cpp): the input is written into one end
// of a socket pair, as a worker or driver would have sent it, and Channel::receive reads frames
// (8-byte length, CBOR body) from the other end until the stream ends.
// Oracles: a frame either decodes or is refit::Error (kProtocol for a bad frame, kPeerLost at
// the end of the stream, kTimeout if a frame stops short); no crash, hang or huge allocation.
//
// It found two faults in channel.cpp, since fixed (docs/RELIABILITY.md, "Fuzzing"), whose inputs
// stay in fuzz/corpus/channel/: a CBOR body nested some thousands deep overflowed the stack in
// nlohmann::json::from_cbor (now refused past 64 levels), and a frame length of up to 4 GiB was
// allocated before a byte of the body had arrived (now capped at 1 GiB, read in 16 MiB pieces).
// In scripts/fuzz.sh's default targets, so CI runs it. Alone: scripts/fuzz.sh 60 channel
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <thread>

#include "fuzz_common.h"
#include "sync/channel.h"

using namespace refit;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  int fds[2];
  FUZZ_CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0);
  // A writer thread, so that an input larger than the socket buffer does not block.
  std::thread writer([&] {
    size_t sent = 0;
    while (sent < size) {
      ssize_t n = ::send(fds[1], data + sent, size - sent, MSG_NOSIGNAL);
      if (n <= 0) break;
      sent += static_cast<size_t>(n);
    }
    ::close(fds[1]);
  });
  Channel channel(fds[0], "worker 0");
  for (int frames = 0; frames < 1000; ++frames) {
    try {
      channel.receive(deadline_after(std::chrono::seconds(2)));
    } catch (const Error& e) {
      FUZZ_CHECK(e.kind() == ErrorKind::kProtocol || e.kind() == ErrorKind::kPeerLost ||
                 e.kind() == ErrorKind::kTimeout);
      break;
    }
  }
  channel.close();
  writer.join();
  return 0;
}
