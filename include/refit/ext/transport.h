// Extension tier (refit/ext/: for backends, benches and bindings built on refit, not for its
// users' programs). The interface every transport backend implements (UCX, CUDA IPC, NCCL;
// in-process for tests; the Python binding's transports over NIXL and others).
// A transport moves bytes between processes and nothing else: it knows no models, layouts or
// buckets. The engine above it uses three services:
//   - memory: register a buffer so that peers can read it one-sided;
//   - peers: an opaque address blob goes into metadata; connect() turns a peer's blob into a PeerId;
//   - data and control: reads pull bytes from a peer's registered region into local memory, posted
//     and then tested or waited for, so that one thread keeps reads from many peers in flight (as
//     NIXL's prepare/post/check); send()/receive() carry small control messages, ordered per pair,
//     and try_receive() with activity()/wait_activity() let one thread serve every peer at once.
// All blocking calls take a deadline and throw Error(kTimeout) past it, Error(kPeerLost) when
// the peer went away, Error(kTransport) for other failures; messages name the peer's label.
// A transport instance is used by one engine thread at a time; backends may run internal
// progress threads.
//
// Transfer buffers come from allocate_memory(), so that each backend places them where its
// peers read them fastest (UCX: shared memory that a local peer maps, making a read one copy);
// register_memory() serves memory the caller already has (model parameters).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "refit/deadline.h"
#include "refit/error.h"

namespace refit {

using Bytes = std::vector<uint8_t>;
using RegionId = uint64_t;
using PeerId = uint64_t;
using ReadId = uint64_t;

// What a peer needs to read a registered region: its address in the owner's address space,
// its length and the backend's packed access key. Serialized into metadata.
struct RemoteRegion {
  uint64_t address = 0;
  uint64_t length = 0;
  Bytes key;
  bool operator==(const RemoteRegion&) const = default;
};

// What a backend can do, for the engine's choices and for `refit info`.
struct TransportCapabilities {
  bool async_reads = false;       // post_read returns before the bytes are here (false: it does the whole read)
  bool maps_peer_memory = false;  // map() can hand out a peer's buffers (same host)
  // map() reaches memory the peer registered with register_memory() too, not only memory it got
  // from allocate_memory(): a source's own tensors can then be read in place.
  bool maps_registered_memory = false;
  // post_read reaches memory a peer registered with register_memory(), not only its buffers: a
  // destination anywhere can then read a source's own tensors, which the source need not pack.
  bool reads_registered_memory = false;
  // post_reads() takes many ranges in one backend call (NIXL: one transfer of a descriptor list).
  bool batched_reads = false;
  bool host_memory = true;     // registers and reads host memory
  bool device_memory = false;  // registers and reads GPU memory
  bool remote_peers = false;   // reaches peers on other hosts
};

class Transport {
 public:
  virtual ~Transport() = default;

  // "UCX", "INPROC", ...
  virtual std::string name() const = 0;

  // Registers [base, base + bytes) for one-sided reads by peers and for local use as a read
  // target. The memory stays owned by the caller and must outlive the registration.
  virtual RegionId register_memory(void* base, size_t bytes) = 0;
  // Allocates `bytes` of zero-filled memory where this backend's peers read it fastest (UCX: host
  // memory, or the configured GPU with device cuda; CUDA IPC and NCCL: the configured GPU) and
  // registers it; deregister_memory frees it.
  struct Allocation {
    RegionId region = 0;
    std::byte* base = nullptr;
  };
  virtual Allocation allocate_memory(size_t bytes) = 0;
  virtual RemoteRegion describe(RegionId region) const = 0;
  virtual void deregister_memory(RegionId region) = 0;
  // The range worth registering to cover `bytes` at `base`: the whole allocation that holds them
  // where a backend knows it (CUDA IPC: the cudaMalloc allocation), so that one registration
  // serves every tensor in it; otherwise the bytes themselves.
  struct Extent {
    const std::byte* base = nullptr;
    size_t bytes = 0;
  };
  virtual Extent registration_extent(const std::byte* base, size_t bytes) const { return {base, bytes}; }
  // False when the memory under a registration is no longer what was registered (freed and
  // allocated again where a backend can tell: CUDA IPC compares the allocation's identity), so
  // that a caller caching registrations across refits registers again.
  virtual bool registration_current(RegionId region) const { return true; }

  // This endpoint's address, to be carried to peers inside metadata.
  virtual Bytes address() const = 0;

  // Connects to a peer from its address. `label` names the peer in errors ("source rank 3").
  virtual PeerId connect(std::span<const uint8_t> peer_address, const std::string& label) = 0;
  virtual void disconnect(PeerId peer) = 0;

  virtual TransportCapabilities capabilities() const = 0;

  // Starts copying `length` bytes at `remote_offset` of the peer's region into `local`, which lies
  // inside `local_region`, and returns its id. Every posted read must end in test_read() returning
  // true, wait_read() or cancel_read(); `local` must stay valid until then. Invalid arguments throw
  // here; failures of the copy itself throw from test_read/wait_read. A backend without
  // async_reads does the whole read here, by `deadline`.
  virtual ReadId post_read(PeerId peer, const RemoteRegion& remote, uint64_t remote_offset, void* local,
                           RegionId local_region, uint64_t length, Deadline deadline) = 0;
  // True once the bytes are in local memory (the read is then over); throws the read's error.
  virtual bool test_read(ReadId read) = 0;
  // Returns when the bytes are in local memory; throws Error(kTimeout) past the deadline (the read
  // is then cancelled), or the read's error.
  virtual void wait_read(ReadId read, Deadline deadline) = 0;
  // Stops a read: once this returns, nothing more is written into its local memory. UCX cannot
  // cancel a read in flight and closes the connection to its peer instead.
  virtual void cancel_read(ReadId read) = 0;
  // One range of post_reads(): `length` bytes at `remote_offset` of `*remote` into `local`.
  struct ReadRange {
    const RemoteRegion* remote = nullptr;
    uint64_t remote_offset = 0;
    void* local = nullptr;
    uint64_t length = 0;
  };
  // With batched_reads: starts reading every range into `local_region` as one read, whose id is
  // over once all are in. Backends without it throw Error(kUnsupported); post each range instead.
  virtual ReadId post_reads(PeerId peer, std::span<const ReadRange> ranges, RegionId local_region, Deadline deadline) {
    throw Error(ErrorKind::kUnsupported, name() + " reads one range at a time (no batched_reads)");
  }
  // post_read, then wait_read.
  void read(PeerId peer, const RemoteRegion& remote, uint64_t remote_offset, void* local, RegionId local_region,
            uint64_t length, Deadline deadline) {
    wait_read(post_read(peer, remote, remote_offset, local, local_region, length, deadline), deadline);
  }

  // The peer's region as memory this process can read directly (shared memory of a peer on this
  // host, a CUDA IPC mapping), or null when only read() reaches it. Lets a destination load
  // straight from its source's buffer, one copy fewer. Valid until disconnect(peer).
  virtual const std::byte* map(PeerId peer, const RemoteRegion& remote) { return nullptr; }

  // What carries this process's traffic to `peer`, for reports: "UCX posix/memory, tcp/eth0",
  // "CUDA_IPC". Meaningful once something has been exchanged with the peer.
  virtual std::string route(PeerId peer) { return name(); }

  // Sends one control message; messages from one endpoint to another arrive in order, whole.
  virtual void send(PeerId peer, std::span<const uint8_t> message, Deadline deadline) = 0;

  // Waits for the next control message from `peer`.
  virtual Bytes receive(PeerId peer, Deadline deadline) = 0;
  // The next control message from `peer` if one is here, without waiting; throws as receive()
  // does when the peer is lost. The receive loop calls it for every link on every turn, so a
  // backend answers it from what it holds (no exception for "nothing yet").
  virtual std::optional<Bytes> try_receive(PeerId peer) = 0;

  // One thread serving many peers: take activity(), look at every peer (try_receive, test_read),
  // and when nothing was ready, wait_activity() until the count moves past what was taken (a
  // message arrived, a read ended, a peer was lost) or the deadline. Wakes may be spurious. A
  // backend without a count returns 0 and its wait_activity() sleeps a short slice.
  virtual uint64_t activity() { return 0; }
  virtual void wait_activity(uint64_t seen, Deadline deadline);
};

// What each backend offers on this machine and in this build, or why it is unavailable (for
// `refit info` and for users choosing a backend).
struct TransportBackendInfo {
  std::string name;  // a backend_name: "UCX", "CUDA_IPC", "NCCL"
  bool available = false;
  std::string detail;  // what it offers here (UCX: version, transports, memory types), or why not
};
std::vector<TransportBackendInfo> transport_backends();

// Backend selection by `backend_name` with its `backend_init_params`. Throws Error(kConfig) for
// an unknown name or parameter.
std::unique_ptr<Transport> create_transport(const std::string& backend_name,
                                            const std::map<std::string, std::string>& init_params);

}  // namespace refit
