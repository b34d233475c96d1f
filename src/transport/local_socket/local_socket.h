// A control channel between processes of one host, for transports whose data path has no
// messages of its own (CUDA IPC, NCCL). Each endpoint listens on an abstract Unix socket named
// after its random id ("@refit-<tag>-<hex id>": nothing on the file system to clean up) and runs
// one thread that accepts connections, reads frames and watches for closed connections.
//
// A link is one direction: connect() opens a stream to the peer and introduces this endpoint by
// id; messages the peer sends back arrive on the peer's own link to us, and are queued by sender
// id and channel. So receive() works as soon as the peer has connected to us, whether or not we
// connected to it first, and messages from one endpoint to another arrive in order, whole.
//
// Wire format (little-endian, encoded and decoded in control_frame.h with core/wire.h): every
// frame is u32 length, then `length` bytes of body; a body is u8 type, u8 channel, payload. The
// first frame on a connection is HELLO: magic "RFLS", u8 version, the sender id (16 bytes) and the
// id it expects to reach (16 bytes). DATA frames carry a message; BYE says that the sender closes
// on purpose (disconnect or destruction). A connection that sends anything else is closed.
//
// Peer loss: when a peer's process exits or is killed the kernel closes its sockets; our link to
// it and its connection to us end (the latter without BYE), and receive() on that peer fails with
// Error(kPeerLost) naming its label at once, after the messages that arrived before; send() fails
// the same way. So does a peer that destroys its endpoint. A peer that only disconnect()s says
// BYE and may connect again: it is not lost. Every blocking call takes a deadline (kTimeout).
// A process that forks after creating an endpoint hands copies of its sockets to the child, which
// keeps them open: fork before creating endpoints (as the local launcher does).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "core/random_id.h"
#include "refit/deadline.h"
#include "refit/ext/transport.h"

namespace refit {

using EndpointId = RandomId;  // random_id()

std::string to_hex(std::span<const uint8_t> bytes);

class LocalSocketEndpoint {
 public:
  using LinkId = uint64_t;
  using Handler = std::function<void(const EndpointId& sender, Bytes message)>;
  // Frames larger than this are refused as malformed (a corrupted length must not allocate GiBs).
  static constexpr uint32_t kMaxMessageBytes = 1u << 30;

  // Listens under a fresh random id. `tag` goes into the socket name ("cuda-ipc", "nccl").
  // Throws Error(kTransport) when the socket cannot be created.
  explicit LocalSocketEndpoint(std::string_view tag);
  // Says BYE on every link, closes every connection and stops the thread.
  ~LocalSocketEndpoint();
  LocalSocketEndpoint(const LocalSocketEndpoint&) = delete;
  LocalSocketEndpoint& operator=(const LocalSocketEndpoint&) = delete;

  const EndpointId& id() const;
  const std::string& tag() const;
  // "@refit-<tag>-<hex id>" as shown in messages.
  std::string socket_name() const;

  // Opens a link to the endpoint `peer` listening under `tag`. Error(kPeerLost) when nothing
  // listens there (the peer exited, or lives in another network namespace), Error(kTimeout)
  // when the connection is not accepted before the deadline.
  LinkId connect(const EndpointId& peer, std::string_view tag, const std::string& label, Deadline deadline);
  // Says BYE and closes the link. Messages already received from the peer stay queued.
  void disconnect(LinkId link);

  // Sends one message on `channel` (0 carries the transport's send()/receive(); backends use
  // others for their own protocol).
  void send(LinkId link, uint8_t channel, std::span<const uint8_t> message, Deadline deadline);
  // The next message from the link's peer on `channel`, in order.
  Bytes receive(LinkId link, uint8_t channel, Deadline deadline);
  // The next message if one is queued; throws Error(kPeerLost) when the peer is gone and
  // nothing is queued.
  std::optional<Bytes> try_receive(LinkId link, uint8_t channel);
  // A count that moves whenever a message arrives or a connection ends (Transport::activity()),
  // and a wait for it to move past `seen`.
  uint64_t activity();
  void wait_activity(uint64_t seen, Deadline deadline);

  // Throws Error(kPeerLost) naming the link's label when its peer is gone (either connection
  // closed); `doing` says what we were doing ("reading 4 MiB from source rank 0").
  void check_alive(LinkId link, std::string_view doing);
  bool alive(LinkId link);

  // Messages on `channel` from any sender are handed to `handler` on the endpoint's thread
  // instead of being queued. Set before peers connect; the handler must not block for long.
  void set_handler(uint8_t channel, Handler handler);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// What identifies this host and process to a peer. CUDA IPC and the local control channel work
// only between processes of one host (and one network namespace).
struct LocalIdentity {
  std::string host;      // boot id + "/" + hostname
  EndpointId process{};  // random per process (regenerated after fork), to tell "same process"
  uint32_t pid = 0;
};
LocalIdentity local_identity();

}  // namespace refit
