#include "transport/nccl/nccl_transport.h"

#include "core/fail.h"
#include "refit/device.h"

#if defined(REFIT_HAVE_CUDA) && defined(REFIT_HAVE_NCCL)

#include <nccl.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

#include "memory/cuda/cuda_util.h"
#include "refit/ext/device_memory.h"
#include "transport/handle_table.h"
#include "transport/local_socket/init_params.h"
#include "transport/local_socket/local_peer.h"
#include "transport/local_socket/local_socket.h"
#include "transport/nccl/nccl_wire.h"
#include "transport/synchronous_reads.h"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "the NCCL transport needs NCCL 2.14 or newer (non-blocking communicators)"
#endif

namespace refit {
namespace {

constexpr std::string_view kSocketTag = "nccl";
// Control-channel channels.
constexpr uint8_t kMessages = 0;  // the transport's send()/receive()
constexpr uint8_t kSetup = 1;     // ncclUniqueId from rank 0 to rank 1
constexpr uint8_t kRequest = 2;   // read requests, to the owner's service thread
constexpr uint8_t kReply = 3;     // error replies to read requests
constexpr auto kCloseTimeout = std::chrono::seconds(5);

std::string nccl_text(ncclResult_t result, ncclComm_t comm) {
  std::string text = ncclGetErrorString(result);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') text += fmt::format(" ({})", last);
  return text;
}

struct Region {
  std::byte* base = nullptr;
  size_t bytes = 0;
  DeviceBuffer owned;
};

struct Peer {
  std::string label;
  LocalSocketEndpoint::LinkId link = 0;
  LocalPeerAddress address;
  int rank = 0;
  int peer_rank = 1;
  std::mutex comm_mutex;  // one NCCL operation at a time on the communicator
  ncclComm_t comm = nullptr;
  std::string broken;  // why the communicator was aborted; under comm_mutex
  bool ready = false;  // the communicator is initialized; under the transport's peers_mutex_
};

struct Request : NcclReadRequest {
  EndpointId sender{};
};

static_assert(sizeof(ncclUniqueId::internal) == kNcclUniqueIdBytes);

// An ncclUniqueId is 128 opaque bytes (ncclUniqueId::internal): copied as bytes, both ways.
NcclUniqueIdBytes unique_id_bytes(const ncclUniqueId& id) {
  NcclUniqueIdBytes bytes;
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(id.internal[i]);
  return bytes;
}

ncclUniqueId unique_id(const NcclUniqueIdBytes& bytes) {
  ncclUniqueId id{};
  for (size_t i = 0; i < bytes.size(); ++i) id.internal[i] = static_cast<char>(bytes[i]);
  return id;
}

class NcclTransport final : public SynchronousReads {
 public:
  NcclTransport(Device device, double timeout_s)
      : device_(resolve_cuda_device(device)), timeout_s_(timeout_s), control_(kSocketTag) {
    cuda::DeviceGuard guard(device_);
    char bus[32] = {};
    cuda::check(cudaDeviceGetPCIBusId(bus, sizeof(bus), device_), "cudaDeviceGetPCIBusId",
                fmt::format("identifying cuda:{}", device_), ErrorKind::kUnsupported);
    cuda::check(cudaStreamCreateWithFlags(&recv_stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags",
                "creating the NCCL receive stream", ErrorKind::kUnsupported);
    cuda::check(cudaStreamCreateWithFlags(&send_stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags",
                "creating the NCCL send stream", ErrorKind::kUnsupported);
    LocalPeerAddress self;
    self.endpoint = control_.id();
    self.identity = local_identity();
    self.device = device_;
    self.bus_id = bus;
    self_ = self;
    address_ = encode_local_peer_address(kNcclAddressMagic, self);
    control_.set_handler(kRequest, [this](const EndpointId& sender, Bytes message) { enqueue(sender, message); });
    service_ = std::thread([this] { serve(); });
  }

  ~NcclTransport() override {
    stopping_ = true;
    // Taking each mutex once orders the flag before any waiter's next check: no lost wake-up.
    { std::lock_guard lock(queue_mutex_); }
    { std::lock_guard lock(peers_mutex_); }
    queue_changed_.notify_all();
    peers_changed_.notify_all();
    service_.join();
    std::vector<PeerId> ids;
    for (auto& [id, peer] : peers_) ids.push_back(id);
    for (PeerId id : ids) {
      try {
        disconnect(id);
      } catch (const std::exception& e) {
        spdlog::warn("NCCL transport teardown: {}", e.what());
      }
    }
    cuda::DeviceGuard guard(device_);
    cudaStreamDestroy(recv_stream_);
    cudaStreamDestroy(send_stream_);
    cudaGetLastError();
  }

  std::string name() const override { return "NCCL"; }
  TransportCapabilities capabilities() const override {
    // Reads are send/receive pairs on the GPU, served by the owner's thread. NCCL itself reaches
    // other hosts, but this backend's control channel is a local socket: peers on one host only.
    return {.async_reads = false,
            .maps_peer_memory = false,
            .host_memory = false,
            .device_memory = true,
            .remote_peers = false};
  }

  RegionId register_memory(void* base, size_t bytes) override {
    if (bytes > 0 && memory_kind_of(base) != MemoryKind::kCuda)
      fail(ErrorKind::kUnsupported, "the NCCL transport moves GPU memory only; {} bytes at {} are not GPU memory",
           bytes, base);
    Region region;
    region.base = static_cast<std::byte*>(base);
    region.bytes = bytes;
    return add(std::move(region));
  }

  Allocation allocate_memory(size_t bytes) override {
    Region region;
    region.owned = DeviceBuffer(Device{Device::Kind::kCuda, device_}, bytes);
    region.base = region.owned.data();
    region.bytes = bytes;
    std::byte* base = region.base;
    return {add(std::move(region)), base};
  }

  RemoteRegion describe(RegionId id) const override {
    std::lock_guard lock(regions_mutex_);
    const Region& r = find_region(id, "describing a region");
    return {reinterpret_cast<uint64_t>(r.base), r.bytes, encode_nccl_key({control_.id(), id})};
  }

  void deregister_memory(RegionId id) override {
    std::lock_guard lock(regions_mutex_);  // waits for a send from the region in flight
    regions_.take(id, "deregistering a region");
  }

  Bytes address() const override { return address_; }

  PeerId connect(std::span<const uint8_t> peer_address, const std::string& label) override {
    LocalPeerAddress remote = decode_local_peer_address(kNcclAddressMagic, "NCCL", peer_address, label);
    if (remote.identity.host != self_.identity.host) {
      fail(ErrorKind::kTransport,
           "the NCCL transport's control channel is local: {} runs on host '{}', this process on '{}'", label,
           remote.identity.host, self_.identity.host);
    }
    if (!remote.bus_id.empty() && remote.bus_id == self_.bus_id) {
      fail(ErrorKind::kUnsupported,
           "NCCL cannot put two ranks on one GPU: {} uses the same GPU as this process (cuda:{}, PCI {}); use "
           "backend_name CUDA_IPC for peers that share a GPU",
           label, device_, self_.bus_id);
    }
    const Deadline deadline = deadline_after(std::chrono::duration<double>(timeout_s_));
    auto peer = std::make_shared<Peer>();
    peer->label = label;
    peer->address = remote;
    const bool first = self_.endpoint < remote.endpoint;
    peer->rank = first ? 0 : 1;
    peer->peer_rank = first ? 1 : 0;
    peer->link = control_.connect(remote.endpoint, kSocketTag, label, deadline);
    const uint64_t generation = ++generations_[remote.endpoint];
    try {
      const std::string what = fmt::format("setting up the NCCL communicator with {}", label);
      ncclUniqueId id{};
      if (first) {
        ncclResult_t result = ncclGetUniqueId(&id);
        if (result != ncclSuccess)
          fail(ErrorKind::kTransport, "{}: ncclGetUniqueId: {}", what, ncclGetErrorString(result));
        control_.send(peer->link, kSetup, encode_nccl_setup({generation, unique_id_bytes(id)}), deadline);
      } else {
        while (true) {
          const NcclSetup setup = decode_nccl_setup(control_.receive(peer->link, kSetup, deadline), label);
          const uint64_t theirs = setup.generation;
          if (theirs == generation) {
            id = unique_id(setup.id);
            break;
          }
          if (theirs > generation)
            fail(ErrorKind::kProtocol, "{}: it is at connection {}, this process at {}", what, theirs, generation);
          // An older attempt's id (that attempt failed): skip it.
        }
      }
      cuda::DeviceGuard guard(device_);
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;
      ncclResult_t result = ncclCommInitRankConfig(&peer->comm, 2, id, peer->rank, &config);
      if (result != ncclSuccess && result != ncclInProgress) {
        std::string text = nccl_text(result, peer->comm);
        if (peer->comm != nullptr) ncclCommAbort(peer->comm);
        peer->comm = nullptr;
        fail(ErrorKind::kTransport, "{}: ncclCommInitRankConfig: {}", what, text);
      }
      wait_ready(*peer, deadline, what);
    } catch (...) {
      if (peer->comm != nullptr) ncclCommAbort(peer->comm);
      control_.disconnect(peer->link);
      throw;
    }
    PeerId id = 0;
    {
      std::lock_guard lock(peers_mutex_);
      peer->ready = true;
      id = peers_.add(peer);
      by_endpoint_[remote.endpoint] = peer;
    }
    peers_changed_.notify_all();
    return id;
  }

  void disconnect(PeerId id) override {
    std::shared_ptr<Peer> peer;
    {
      std::lock_guard lock(peers_mutex_);
      peer = peers_.take(id, "disconnecting");
      auto by = by_endpoint_.find(peer->address.endpoint);
      if (by != by_endpoint_.end() && by->second == peer) by_endpoint_.erase(by);
    }
    {
      std::lock_guard comm_lock(peer->comm_mutex);  // waits for an operation in flight
      if (peer->comm != nullptr) {
        cuda::DeviceGuard guard(device_);
        bool clean = peer->broken.empty() && control_.alive(peer->link);
        if (clean) {
          ncclResult_t result = ncclCommFinalize(peer->comm);
          clean = result == ncclSuccess || result == ncclInProgress;
        }
        if (clean) {
          try {
            wait_ready(*peer, deadline_after(kCloseTimeout), "closing the NCCL communicator with " + peer->label);
          } catch (const std::exception& e) {
            spdlog::warn("{}", e.what());
            clean = false;
          }
        }
        if (peer->comm != nullptr) {
          if (clean) {
            ncclCommDestroy(peer->comm);
          } else {
            ncclCommAbort(peer->comm);
          }
          peer->comm = nullptr;
        }
      }
    }
    control_.disconnect(peer->link);
  }

  void read_now(PeerId id, const RemoteRegion& remote, uint64_t remote_offset, void* local, RegionId local_region,
                uint64_t length, Deadline deadline) override {
    std::shared_ptr<Peer> peer = find_peer(id, "reading");
    const std::string what = fmt::format("reading {} bytes from {} (offset {})", length, peer->label, remote_offset);
    {
      std::lock_guard lock(regions_mutex_);
      const Region& region = find_region(local_region, what);
      const auto* target = static_cast<const std::byte*>(local);
      if (target < region.base || length > region.bytes ||
          target - region.base > static_cast<ptrdiff_t>(region.bytes - length)) {
        fail(ErrorKind::kInvalidArgument, "{}: the local buffer {} lies outside local region {} ({} bytes at {})", what,
             local, local_region, region.bytes, static_cast<void*>(region.base));
      }
    }
    if (remote_offset > remote.length || length > remote.length - remote_offset)
      fail(ErrorKind::kInvalidArgument, "{}: the remote region holds only {} bytes", what, remote.length);
    const NcclRegionKey key = decode_nccl_key(remote.key, peer->label);
    if (key.owner != peer->address.endpoint)
      fail(ErrorKind::kProtocol, "{}: the region was described by another endpoint than {}", what, peer->label);
    if (length == 0) return;
    control_.check_alive(peer->link, what);

    std::lock_guard comm_lock(peer->comm_mutex);
    usable(*peer, what);
    const uint64_t request_id = ++next_request_;
    control_.send(peer->link, kRequest, encode_nccl_request({request_id, key.region, remote_offset, length}), deadline);

    cuda::DeviceGuard guard(device_);
    ncclResult_t result = ncclRecv(local, length, ncclUint8, peer->peer_rank, peer->comm, recv_stream_);
    if (result != ncclSuccess && result != ncclInProgress)
      abort_comm(*peer, what, ErrorKind::kTransport, "ncclRecv: " + nccl_text(result, peer->comm));
    uint64_t spins = 0;
    bool posted = false;
    while (true) {
      if (!posted) {
        ncclResult_t state = ncclSuccess;
        ncclCommGetAsyncError(peer->comm, &state);
        if (state == ncclSuccess)
          posted = true;
        else if (state != ncclInProgress)
          abort_comm(*peer, what, ErrorKind::kTransport, nccl_text(state, peer->comm));
      }
      if (posted && stream_finished(*peer, recv_stream_, what)) break;
      std::optional<Bytes> reply;
      try {
        reply = control_.try_receive(peer->link, kReply);
      } catch (const Error& e) {
        abort_comm(*peer, what, ErrorKind::kPeerLost, e.what());
      }
      if (reply) {
        NcclReply answer;
        try {
          answer = decode_nccl_reply(*reply, peer->label);
        } catch (const Error& e) {
          abort_comm(*peer, what, ErrorKind::kProtocol, e.what());
        }
        if (answer.request == request_id)
          abort_comm(*peer, what, ErrorKind::kTransport,
                     fmt::format("{} refused the read: {}", peer->label, answer.error));
      }
      if (expired(deadline))
        abort_comm(*peer, what, ErrorKind::kTimeout, "the transfer did not finish before the deadline");
      cuda::poll_pause(spins);
    }
  }

  void send(PeerId id, std::span<const uint8_t> message, Deadline deadline) override {
    control_.send(find_peer(id, "sending a message")->link, kMessages, message, deadline);
  }

  Bytes receive(PeerId id, Deadline deadline) override {
    return control_.receive(find_peer(id, "receiving a message")->link, kMessages, deadline);
  }
  std::optional<Bytes> try_receive(PeerId id) override {
    return control_.try_receive(find_peer(id, "receiving a message")->link, kMessages);
  }
  uint64_t activity() override { return control_.activity(); }
  void wait_activity(uint64_t seen, Deadline deadline) override { control_.wait_activity(seen, deadline); }

 private:
  RegionId add(Region region) {
    std::lock_guard lock(regions_mutex_);
    return regions_.add(std::move(region));
  }

  // Under regions_mutex_.
  const Region& find_region(RegionId id, std::string_view doing) const { return regions_.find(id, doing); }

  std::shared_ptr<Peer> find_peer(PeerId id, std::string_view doing) {
    std::lock_guard lock(peers_mutex_);
    return peers_.find(id, doing);
  }

  // Under the peer's comm_mutex.
  static void usable(const Peer& peer, std::string_view what) {
    if (!peer.broken.empty() || peer.comm == nullptr)
      fail(ErrorKind::kTransport, "{}: the NCCL communicator with {} was aborted ({}); connect again", what, peer.label,
           peer.broken);
  }

  // Aborts the pair's communicator (an operation in flight can only be cancelled that way) and
  // throws. Under the peer's comm_mutex.
  // True once `stream` has finished; aborts the communicator when the stream or NCCL failed.
  bool stream_finished(Peer& peer, cudaStream_t stream, std::string_view what) {
    const cudaError_t status = cudaStreamQuery(stream);
    if (status == cudaSuccess) return true;
    if (status != cudaErrorNotReady) {
      cudaGetLastError();
      abort_comm(peer, what, ErrorKind::kTransport, "cudaStreamQuery: " + cuda::error_text(status));
    }
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(peer.comm, &state);
    if (state != ncclSuccess && state != ncclInProgress)
      abort_comm(peer, what, ErrorKind::kTransport, nccl_text(state, peer.comm));
    return false;
  }

  [[noreturn]] void abort_comm(Peer& peer, std::string_view what, ErrorKind kind, const std::string& why) {
    if (peer.comm != nullptr) {
      ncclCommAbort(peer.comm);
      peer.comm = nullptr;
    }
    peer.broken = fmt::format("{} failed: {}", what, why);
    fail(kind, "{}: {}; the NCCL communicator was aborted", what, why);
  }

  // Polls ncclCommGetAsyncError until the communicator's pending call completed.
  void wait_ready(Peer& peer, Deadline deadline, std::string_view what) {
    uint64_t spins = 0;
    while (true) {
      ncclResult_t state = ncclSuccess;
      ncclResult_t result = ncclCommGetAsyncError(peer.comm, &state);
      if (result != ncclSuccess) state = result;
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) abort_comm(peer, what, ErrorKind::kTransport, nccl_text(state, peer.comm));
      if (!control_.alive(peer.link))
        abort_comm(peer, what, ErrorKind::kPeerLost, fmt::format("lost {}: its control connection closed", peer.label));
      if (expired(deadline)) abort_comm(peer, what, ErrorKind::kTimeout, "NCCL did not finish before the deadline");
      cuda::poll_pause(spins);
    }
  }

  void enqueue(const EndpointId& sender, const Bytes& message) {
    Request request;
    request.sender = sender;
    try {
      static_cast<NcclReadRequest&>(request) = decode_nccl_request(message, "endpoint " + to_hex(sender));
    } catch (const Error& e) {
      spdlog::warn("dropping a read request: {}", e.what());
      return;
    }
    {
      std::lock_guard lock(queue_mutex_);
      requests_.push_back(request);
    }
    queue_changed_.notify_all();
  }

  // The owner's side of read(): one request at a time, in arrival order.
  void serve() {
    while (true) {
      Request request;
      {
        std::unique_lock lock(queue_mutex_);
        queue_changed_.wait(lock, [&] { return stopping_ || !requests_.empty(); });
        if (stopping_) return;
        request = requests_.front();
        requests_.pop_front();
      }
      try {
        serve_one(request);
      } catch (const std::exception& e) {
        spdlog::error("NCCL transport: serving a read request failed: {}", e.what());
      }
    }
  }

  void serve_one(const Request& request) {
    const Deadline deadline = deadline_after(std::chrono::duration<double>(timeout_s_));
    std::shared_ptr<Peer> peer;
    {
      // A reader may ask as soon as its own connect() returned, before ours registered the pair.
      std::unique_lock lock(peers_mutex_);
      peers_changed_.wait_until(lock, deadline, [&] {
        if (stopping_) return true;
        auto it = by_endpoint_.find(request.sender);
        return it != by_endpoint_.end() && it->second->ready;
      });
      auto it = by_endpoint_.find(request.sender);
      if (it == by_endpoint_.end()) {
        spdlog::warn("NCCL transport: a read request from endpoint {}, which is not connected, was dropped",
                     to_hex(request.sender));
        return;
      }
      peer = it->second;
    }
    const std::string what = fmt::format("sending {} bytes (region {}, offset {}) to {}", request.length,
                                         request.region, request.offset, peer->label);
    std::string refusal;
    try {
      std::lock_guard regions_lock(regions_mutex_);  // the region stays registered while we send from it
      const Region* region = regions_.find_if_present(request.region);
      if (region == nullptr) {
        refusal = fmt::format("region {} is not registered (it was released)", request.region);
      } else if (request.offset > region->bytes || request.length > region->bytes - request.offset) {
        refusal = fmt::format("{} bytes at offset {} lie outside region {} of {} bytes", request.length, request.offset,
                              request.region, region->bytes);
      } else {
        std::lock_guard comm_lock(peer->comm_mutex);
        usable(*peer, what);
        cuda::DeviceGuard guard(device_);
        ncclResult_t result = ncclSend(region->base + request.offset, request.length, ncclUint8, peer->peer_rank,
                                       peer->comm, send_stream_);
        if (result != ncclSuccess && result != ncclInProgress)
          abort_comm(*peer, what, ErrorKind::kTransport, "ncclSend: " + nccl_text(result, peer->comm));
        wait_ready(*peer, deadline, what);
        uint64_t spins = 0;
        while (true) {
          if (stream_finished(*peer, send_stream_, what)) break;
          if (!control_.alive(peer->link)) abort_comm(*peer, what, ErrorKind::kPeerLost, "the reader went away");
          if (stopping_) abort_comm(*peer, what, ErrorKind::kTransport, "the transport is shutting down");
          if (expired(deadline))
            abort_comm(*peer, what, ErrorKind::kTimeout, "the transfer did not finish before the deadline");
          cuda::poll_pause(spins);
        }
        return;
      }
    } catch (const Error& e) {
      refusal = e.what();
    }
    spdlog::warn("NCCL transport: {}: {}", what, refusal);
    try {
      control_.send(peer->link, kReply, encode_nccl_reply({request.id, refusal}),
                    deadline_after(std::chrono::seconds(2)));
    } catch (const std::exception&) {
      // The reader may be the reason; its own deadline ends its wait.
    }
  }

  int device_;
  double timeout_s_;
  LocalPeerAddress self_;
  Bytes address_;
  cudaStream_t recv_stream_ = nullptr;
  cudaStream_t send_stream_ = nullptr;

  mutable std::mutex regions_mutex_;
  HandleTable<Region> regions_{"NCCL", "region", "registered"};

  std::mutex peers_mutex_;
  std::condition_variable peers_changed_;
  HandleTable<std::shared_ptr<Peer>> peers_{"NCCL", "peer", "connected"};
  std::map<EndpointId, std::shared_ptr<Peer>> by_endpoint_;
  std::map<EndpointId, uint64_t> generations_;  // connects to each endpoint, to skip stale setup messages
  uint64_t next_request_ = 0;

  std::mutex queue_mutex_;
  std::condition_variable queue_changed_;
  std::deque<Request> requests_;
  std::atomic<bool> stopping_{false};
  std::thread service_;
  // Last, so that it is destroyed first: its thread calls enqueue() until then.
  LocalSocketEndpoint control_;
};

}  // namespace

std::unique_ptr<Transport> create_nccl_transport(const std::map<std::string, std::string>& init_params) {
  InitParams params("NCCL", init_params);
  Device device = parse_gpu_device_param("NCCL", params.get("device", "cuda"));
  double timeout_s = params.seconds("timeout_s", 300.0);
  params.finish();
  return std::make_unique<NcclTransport>(device, timeout_s);
}

}  // namespace refit

#else  // no CUDA or no NCCL in this build

namespace refit {

std::unique_ptr<Transport> create_nccl_transport(const std::map<std::string, std::string>&) {
#ifdef REFIT_HAVE_CUDA
  fail(ErrorKind::kUnsupported,
       "backend_name NCCL needs NCCL, and this build has none (libnccl was not found at build time); rebuild with "
       "NCCL installed (REFIT_WITH_NCCL=ON) or use backend_name CUDA_IPC");
#else
  fail(ErrorKind::kUnsupported,
       "backend_name NCCL needs CUDA and NCCL, and this build has no CUDA support; rebuild with REFIT_WITH_CUDA=ON or "
       "use backend_name UCX with device=cpu");
#endif
}

}  // namespace refit

#endif
