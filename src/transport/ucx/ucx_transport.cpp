#include "transport/ucx/ucx_transport.h"

#include <spdlog/spdlog.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <sstream>
#include <type_traits>
#include <vector>

#include "core/fail.h"
#include "transport/handle_table.h"
#include "transport/ucx/ucx_address.h"
#include "transport/ucx/ucx_options.h"
#include "transport/ucx/ucx_progress.h"

namespace refit {
namespace {

constexpr unsigned kMessageAmId = 1;
// How long disconnect() lets a clean close flush outstanding operations.
constexpr auto kCloseTimeout = std::chrono::seconds(2);

class UcxTransport;

// One UCX request as seen by its waiter and its completion callback (both under the owner's
// mutex). A waiter that times out hands it to the owner's `abandoned_` and the callback frees it:
// UCX may finish late without touching freed memory.
struct Operation {
  explicit Operation(UcxTransport* owner) : owner(owner) {}
  UcxTransport* owner;
  bool done = false;
  ucs_status_t status = UCS_OK;
  void* request = nullptr;  // set once abandoned
  Bytes payload;            // a send's copy of its message when an abandoned send may still read it
};

struct Peer {
  UcxTransport* owner = nullptr;
  std::string label;
  InstanceId id{};
  ucp_ep_h ep = nullptr;              // null once closed after a timeout
  std::string timed_out;              // the operation whose timeout closed `ep`
  bool lost = false;                  // under owner's mutex: set by the endpoint error callback
  ucs_status_t lost_status = UCS_OK;  // under owner's mutex
  // From its address: a peer on this host is looked up while an operation waits on it, since UCX
  // does not report every death (a destination killed mid-refit of 4 -> 4 resharding held sends of
  // its sources over shared memory for their whole deadline, ReshardProcesses.ADestinationKilled*).
  ProcessIdentity process;
  bool gone = false;                  // an operation's wait saw its process gone
  std::map<Bytes, ucp_rkey_h> rkeys;  // unpacked remote keys by packed bytes
};

// A control message from one sender, in arrival order. A rendezvous message takes its place in
// the queue when announced and becomes `complete` once its data is here.
struct Inbound {
  UcxTransport* owner = nullptr;
  Bytes data;
  bool complete = false;
  ucs_status_t status = UCS_OK;
};

struct Region {
  void* base = nullptr;
  size_t bytes = 0;
  ucp_mem_h memh = nullptr;  // null for an empty region, which needs no UCX registration
  Bytes rkey;
};

bool is_peer_failure(ucs_status_t status) {
  return status == UCS_ERR_ENDPOINT_TIMEOUT || status == UCS_ERR_CONNECTION_RESET || status == UCS_ERR_UNREACHABLE;
}

struct ContextDeleter {
  void operator()(ucp_context_h context) const { ucp_cleanup(context); }
};
struct WorkerDeleter {
  void operator()(ucp_worker_h worker) const { ucp_worker_destroy(worker); }
};

class UcxTransport final : public Transport {
 public:
  explicit UcxTransport(UcxOptions options);
  ~UcxTransport() override;

  std::string name() const override { return "UCX"; }
  RegionId register_memory(void* base, size_t bytes) override;
  Allocation allocate_memory(size_t bytes) override;
  RemoteRegion describe(RegionId region) const override;
  void deregister_memory(RegionId region) override;
  Bytes address() const override { return address_; }
  PeerId connect(std::span<const uint8_t> peer_address, const std::string& label) override;
  void disconnect(PeerId peer) override;
  TransportCapabilities capabilities() const override;
  ReadId post_read(PeerId peer, const RemoteRegion& remote, uint64_t remote_offset, void* local, RegionId local_region,
                   uint64_t length, Deadline deadline) override;
  bool test_read(ReadId read) override;
  void wait_read(ReadId read, Deadline deadline) override;
  void cancel_read(ReadId read) override;
  const std::byte* map(PeerId peer, const RemoteRegion& remote) override;
  std::string route(PeerId peer) override;
  void send(PeerId peer, std::span<const uint8_t> message, Deadline deadline) override;
  Bytes receive(PeerId peer, Deadline deadline) override;
  std::optional<Bytes> try_receive(PeerId peer) override;
  uint64_t activity() override;
  void wait_activity(uint64_t seen, Deadline deadline) override;

 private:
  static void on_operation_done(void* request, ucs_status_t status, void* user_data);
  static void on_message_data(void* request, ucs_status_t status, size_t length, void* user_data);
  static void on_endpoint_error(void* arg, ucp_ep_h ep, ucs_status_t status);
  static ucs_status_t on_message(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                 const ucp_am_recv_param_t* param);

  void init_ucx();
  // Maps memory with UCX (allocating it when `base` is null) and packs its access key.
  RegionId map_region(void* base, size_t bytes);
  Peer& find_peer(PeerId peer, std::string_view doing);
  const Region& find_region(RegionId region, std::string_view doing) const;
  bool is_lost(const Peer& peer);
  // Throws unless operations on `peer` can proceed; `what` says which ("reading 8 bytes from <label>").
  void check_usable(const Peer& peer, std::string_view what);
  [[noreturn]] static void fail_closed(const Peer& peer, std::string_view what);
  // The peer's next complete message, if one is here; throws when the peer is closed or lost and
  // nothing it sent is left. Under mutex_.
  std::optional<Bytes> take_message(Peer& peer);
  ucp_rkey_h remote_key(Peer& peer, const Bytes& packed);
  // Waits for what ucp_*_nbx returned. Returns the request's status, or nothing when the deadline
  // passed or the process of `watched` (the peer it waits on, looked up every kLivenessSlice) is
  // gone, which `gone` then says: the operation is then abandoned to its callback.
  std::optional<ucs_status_t> wait(ucs_status_ptr_t request, std::unique_ptr<Operation> operation, Deadline deadline,
                                   const Peer* watched = nullptr, bool* gone = nullptr);
  // wait() for a read or send on `peer`; throws naming `what` on timeout or failure.
  void finish(Peer& peer, ucs_status_ptr_t request, std::unique_ptr<Operation> operation, Deadline deadline,
              const std::string& what);
  void complete_inbound(Inbound& message, ucs_status_t status);
  // Closes the endpoint (if still open) and drops its keys; returns false when the close is still
  // running. Forcing cancels outstanding operations; UCX defines it only with peer error handling.
  bool close(Peer& peer, bool force);

  // A posted read: its UCX request until test_read, wait_read or cancel_read ends it.
  struct PendingRead {
    PeerId peer = 0;
    std::string what;
    ucs_status_ptr_t request = nullptr;  // a status when it completed inside ucp_get_nbx
    std::unique_ptr<Operation> operation;
    std::unique_ptr<ProgressThread::Busy> busy;  // the progress thread spins while it is in flight
  };
  PendingRead take_read(ReadId read);

  UcxOptions options_;
  InstanceId id_;
  std::mutex reads_mutex_;
  std::map<ReadId, PendingRead> reads_;  // under reads_mutex_
  ReadId next_read_ = 1;                 // under reads_mutex_

  // Declared before the worker: completion callbacks may still run while it is destroyed.
  std::mutex mutex_;
  std::condition_variable changed_;
  uint64_t activity_ = 0;                                       // moves with every notify of changed_; under mutex_
  std::map<InstanceId, std::deque<Inbound>> inbox_;             // by sender instance; under mutex_
  std::map<Operation*, std::unique_ptr<Operation>> abandoned_;  // timed out, not completed yet; under mutex_
  HandleTable<std::unique_ptr<Peer>> peers_{"UCX", "peer", "connected"};
  std::vector<std::unique_ptr<Peer>> closing_;  // disconnected peers whose endpoint close did not finish in time

  bool shared_memory_ = false;  // the context has a transport through which peers map memory (posix, sysv, xpmem)
  std::unique_ptr<std::remove_pointer_t<ucp_context_h>, ContextDeleter> context_;
  std::unique_ptr<std::remove_pointer_t<ucp_worker_h>, WorkerDeleter> worker_;
  std::unique_ptr<ProgressThread> progress_;  // declared last so that it stops first
  Bytes address_;
  HandleTable<Region> regions_{"UCX", "region", "registered"};
};

// The context's resources as ucp_context_print_info lists them ("#      resource 1  :  md 1  dev 1
// flags -- tcp/eth0"), as "tcp/eth0"; UCX 1.13 has no structured query for them.
std::vector<std::string> context_resources(ucp_context_h context) {
  std::vector<std::string> resources;
  char* text = nullptr;
  size_t size = 0;
  FILE* out = open_memstream(&text, &size);
  if (out == nullptr) return resources;
  ucp_context_print_info(context, out);
  std::fclose(out);
  std::istringstream lines(std::string(text, size));
  std::free(text);
  for (std::string line; std::getline(lines, line);) {
    const auto marker = line.find("-- ");
    if (line.find("resource") != std::string::npos && marker != std::string::npos)
      resources.push_back(line.substr(marker + 3));
  }
  return resources;
}

// Whether the context may reach a peer's memory through a mapping (ucp_rkey_ptr): one of its
// resources is a shared-memory transport.
bool has_shared_memory_transport(ucp_context_h context) {
  for (const std::string& resource : context_resources(context)) {
    const std::string tl = resource.substr(0, resource.find('/'));
    if (tl == "posix" || tl == "sysv" || tl == "xpmem") return true;
  }
  return false;
}

UcxTransport::UcxTransport(UcxOptions options) : options_(std::move(options)), id_(random_id()) { init_ucx(); }

void UcxTransport::init_ucx() {
  UcpConfig config = make_ucp_config(options_);
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  ucp_context_h context = nullptr;
  ucs_status_t status = ucp_init(&params, config.get(), &context);
  if (status != UCS_OK) {
    std::string selection;
    for (const UcxSetting& s : options_.settings) {
      if (s.param == "tls" || s.param == "device_list")
        selection += fmt::format(" {}='{}'", ucx_param_name(s.param), s.value);
    }
    if (status == UCS_ERR_NO_DEVICE && !selection.empty()) {
      fail(ErrorKind::kConfig, "UCX has no usable transport or device for{}: {}", selection, ucs_status_string(status));
    }
    fail(ErrorKind::kTransport, "cannot initialize UCX (ucp_init): {}", ucs_status_string(status));
  }
  context_.reset(context);
  shared_memory_ = has_shared_memory_transport(context);

  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_MULTI;
  ucp_worker_h worker = nullptr;
  {
    UnusedUcxSettings unused(options_);
    status = ucp_worker_create(context_.get(), &worker_params, &worker);
    if (status != UCS_OK) fail(ErrorKind::kTransport, "cannot create a UCX worker: {}", ucs_status_string(status));
    worker_.reset(worker);
    unused.check();
  }

  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE | UCP_WORKER_ATTR_FIELD_ADDRESS;
  status = ucp_worker_query(worker, &attr);
  if (status != UCS_OK) fail(ErrorKind::kTransport, "cannot query the UCX worker: {}", ucs_status_string(status));
  const auto* address = reinterpret_cast<const uint8_t*>(attr.address);
  address_ = encode_ucx_address(id_, this_process(), options_.error_mode == UCP_ERR_HANDLING_MODE_PEER,
                                {address, attr.address_length});
  ucp_worker_release_address(worker, attr.address);
  if (attr.thread_mode != UCS_THREAD_MODE_MULTI) {
    fail(ErrorKind::kTransport, "this UCX library does not support multi-threaded workers (build it with --enable-mt)");
  }

  ucp_am_handler_param_t handler{};
  handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                       UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  handler.id = kMessageAmId;
  handler.cb = on_message;
  handler.arg = this;
  handler.flags = UCP_AM_FLAG_WHOLE_MSG;
  status = ucp_worker_set_am_recv_handler(worker, &handler);
  if (status != UCS_OK)
    fail(ErrorKind::kTransport, "cannot install the UCX message handler: {}", ucs_status_string(status));

  // spdlog's registry is created on first use inside its shared library, where TSan cannot see
  // the once-initialization: create it here, before the progress thread may log.
  spdlog::default_logger_raw();
  progress_ = std::make_unique<ProgressThread>(worker);
}

UcxTransport::~UcxTransport() {
  for (auto& [id, peer] : peers_) close(*peer, options_.error_mode == UCP_ERR_HANDLING_MODE_PEER && is_lost(*peer));
  progress_.reset();
  // Operations that never completed (a peer that stopped without error handling) are released
  // without callback; destroying the worker then purges them, and unfinished closes, while their
  // buffers are still alive.
  std::map<Operation*, std::unique_ptr<Operation>> abandoned;
  {
    std::lock_guard lock(mutex_);
    abandoned.swap(abandoned_);
  }
  for (auto& [pointer, operation] : abandoned) ucp_request_free(operation->request);
  worker_.reset();
  // Only now that no worker can serve them: a read that UCX emulates is answered from the region
  // by this side's progress thread, and may still be queued after its reader gave up on it (a
  // cancelled or timed-out read); unmapping first let the answer read freed memory (UCX 1.22).
  for (auto& [id, region] : regions_) {
    if (region.memh != nullptr) ucp_mem_unmap(context_.get(), region.memh);
  }
}

RegionId UcxTransport::register_memory(void* base, size_t bytes) {
  if (bytes > 0 && base == nullptr)
    fail(ErrorKind::kInvalidArgument, "cannot register {} bytes at a null address with UCX", bytes);
  return map_region(base, bytes);
}

Transport::Allocation UcxTransport::allocate_memory(size_t bytes) {
  RegionId id = map_region(nullptr, bytes);
  return {id, static_cast<std::byte*>(regions_.find(id, "allocating memory").base)};
}

RegionId UcxTransport::map_region(void* base, size_t bytes) {
  Region region{base, bytes, nullptr, {}};
  if (bytes > 0) {
    const bool allocate = base == nullptr;
    ucp_mem_map_params_t params{};
    params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    params.address = base;
    params.length = bytes;
    if (allocate) {
      // UCX places the buffer itself (shared memory first), so a peer on this host maps it and
      // reads it in one copy instead of UCX's emulated, two-sided get.
      params.field_mask |= UCP_MEM_MAP_PARAM_FIELD_FLAGS;
      params.flags = UCP_MEM_MAP_ALLOCATE;
    }
    ucs_status_t status = ucp_mem_map(context_.get(), &params, &region.memh);
    if (status != UCS_OK) {
      fail(ErrorKind::kTransport, "cannot {} {} bytes with UCX (ucp_mem_map): {}", allocate ? "allocate" : "register",
           bytes, ucs_status_string(status));
    }
    if (allocate) {
      ucp_mem_attr_t attr{};
      attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS;
      status = ucp_mem_query(region.memh, &attr);
      if (status != UCS_OK) {
        ucp_mem_unmap(context_.get(), region.memh);
        fail(ErrorKind::kTransport, "cannot query a UCX allocation of {} bytes: {}", bytes, ucs_status_string(status));
      }
      region.base = attr.address;
      std::memset(region.base, 0, bytes);
    }
    void* packed = nullptr;
    size_t packed_size = 0;
    status = ucp_rkey_pack(context_.get(), region.memh, &packed, &packed_size);
    if (status != UCS_OK) {
      ucp_mem_unmap(context_.get(), region.memh);
      fail(ErrorKind::kTransport, "cannot pack the UCX key of {} bytes at {}: {}", bytes, region.base,
           ucs_status_string(status));
    }
    region.rkey.assign(static_cast<uint8_t*>(packed), static_cast<uint8_t*>(packed) + packed_size);
    ucp_rkey_buffer_release(packed);
  }
  return regions_.add(std::move(region));
}

const Region& UcxTransport::find_region(RegionId region, std::string_view doing) const {
  return regions_.find(region, doing);
}

RemoteRegion UcxTransport::describe(RegionId region) const {
  const Region& r = find_region(region, "describing a region");
  return {reinterpret_cast<uint64_t>(r.base), r.bytes, r.rkey};
}

void UcxTransport::deregister_memory(RegionId region) {
  const Region& r = find_region(region, "deregistering a region");
  if (r.memh != nullptr) {
    ucs_status_t status = ucp_mem_unmap(context_.get(), r.memh);
    if (status != UCS_OK) {
      fail(ErrorKind::kTransport, "cannot deregister {} bytes at {} from UCX: {}", r.bytes, r.base,
           ucs_status_string(status));
    }
  }
  regions_.erase(region);
}

PeerId UcxTransport::connect(std::span<const uint8_t> peer_address, const std::string& label) {
  UcxAddress remote = decode_ucx_address(peer_address, label);
  // UCX cannot connect endpoints of two error handling modes, and says only "unsupported".
  const bool peer_errors = options_.error_mode == UCP_ERR_HANDLING_MODE_PEER;
  if (remote.peer_errors != peer_errors)
    fail(ErrorKind::kConfig,
         "{} has {}='{}', this engine '{}': UCX connects only endpoints of one error handling mode; set it the same "
         "on every worker",
         label, ucx_param_name("ucx_error_handling_mode"), remote.peer_errors ? "peer" : "none",
         peer_errors ? "peer" : "none");
  auto peer = std::make_unique<Peer>();
  peer->owner = this;
  peer->label = label;
  peer->id = remote.id;
  peer->process = std::move(remote.process);

  ucp_ep_params_t params{};
  params.field_mask =
      UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(remote.worker_address.data());
  params.err_mode = options_.error_mode;
  params.err_handler.cb = on_endpoint_error;
  params.err_handler.arg = peer.get();
  ucs_status_t status = ucp_ep_create(worker_.get(), &params, &peer->ep);
  if (status != UCS_OK)
    fail(ErrorKind::kTransport, "cannot connect to {} (ucp_ep_create): {}", label, ucs_status_string(status));

  return peers_.add(std::move(peer));
}

void UcxTransport::disconnect(PeerId id) {
  std::unique_ptr<Peer> peer = peers_.take(id, "disconnecting");
  // A failed endpoint cannot flush.
  const bool force = options_.error_mode == UCP_ERR_HANDLING_MODE_PEER && is_lost(*peer);
  // The endpoint's error callback may fire until its close finishes: keep its Peer alive.
  if (!close(*peer, force)) closing_.push_back(std::move(peer));
}

bool UcxTransport::close(Peer& peer, bool force) {
  for (auto& [packed, rkey] : peer.rkeys) ucp_rkey_destroy(rkey);
  peer.rkeys.clear();
  if (peer.ep == nullptr) return true;

  auto operation = std::make_unique<Operation>(this);
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = on_operation_done;
  param.user_data = operation.get();
  param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t request = ucp_ep_close_nbx(peer.ep, &param);
  peer.ep = nullptr;
  // A close that fails still releases the endpoint; one that does not finish in time is released
  // with the worker.
  if (wait(request, std::move(operation), deadline_after(kCloseTimeout))) return true;
  spdlog::warn("closing the UCX connection to {} did not finish within {} s", peer.label, kCloseTimeout.count());
  return false;
}

Peer& UcxTransport::find_peer(PeerId peer, std::string_view doing) { return *peers_.find(peer, doing); }

bool UcxTransport::is_lost(const Peer& peer) {
  std::lock_guard lock(mutex_);
  return peer.lost;
}

void UcxTransport::fail_closed(const Peer& peer, std::string_view what) {
  if (peer.gone)
    fail(ErrorKind::kPeerLost, "lost {}: its process (pid {}) is gone, {}", peer.label, peer.process.pid, what);
  fail(ErrorKind::kTransport, "{}: the connection to {} was closed when {} timed out; connect again", what, peer.label,
       peer.timed_out);
}

void UcxTransport::check_usable(const Peer& peer, std::string_view what) {
  if (peer.ep == nullptr) fail_closed(peer, what);
  std::lock_guard lock(mutex_);
  if (peer.lost)
    fail(ErrorKind::kPeerLost, "lost {} ({}) before {}", peer.label, ucs_status_string(peer.lost_status), what);
}

ucp_rkey_h UcxTransport::remote_key(Peer& peer, const Bytes& packed) {
  auto it = peer.rkeys.find(packed);
  if (it != peer.rkeys.end()) return it->second;
  if (packed.empty()) fail(ErrorKind::kProtocol, "a region of {} carries no UCX access key", peer.label);
  ucp_rkey_h rkey = nullptr;
  ucs_status_t status = ucp_ep_rkey_unpack(peer.ep, packed.data(), &rkey);
  if (status != UCS_OK) {
    fail(ErrorKind::kProtocol, "cannot unpack the UCX access key of a region of {}: {}", peer.label,
         ucs_status_string(status));
  }
  peer.rkeys.emplace(packed, rkey);
  return rkey;
}

const std::byte* UcxTransport::map(PeerId id, const RemoteRegion& remote) {
  Peer& peer = find_peer(id, "mapping a region");
  check_usable(peer, fmt::format("mapping a region of {}", peer.label));
  void* local = nullptr;
  // Succeeds when UCX reaches the region through shared memory (a peer on this host).
  ucs_status_t status = ucp_rkey_ptr(remote_key(peer, remote.key), remote.address, &local);
  if (status != UCS_OK) {
    spdlog::debug("UCX cannot map the region of {} ({}); reads copy it", peer.label, ucs_status_string(status));
    return nullptr;
  }
  return static_cast<const std::byte*>(local);
}

std::string UcxTransport::route(PeerId id) {
  Peer& peer = find_peer(id, "describing the route");
  // ucp_ep_print_info lists the endpoint's lanes ("lane[0]:  3:tcp/eth0.0 md[1] ... am ...");
  // UCX has no structured query for them before 1.14. Collect each lane's transport/device once.
  char* text = nullptr;
  size_t size = 0;
  FILE* out = open_memstream(&text, &size);
  if (out == nullptr) return "UCX";
  ucp_ep_print_info(peer.ep, out);
  std::fclose(out);
  std::vector<std::string> lanes;
  std::istringstream lines(std::string(text, size));
  std::free(text);
  for (std::string line; std::getline(lines, line);) {
    const auto lane = line.find("lane[");
    const auto colon = line.find(':', line.find(']', lane == std::string::npos ? 0 : lane) + 1);
    if (lane == std::string::npos || colon == std::string::npos) continue;
    // After "lane[i]:", an optional resource index and ':', then "tl/device" up to a blank.
    std::istringstream fields(line.substr(colon + 1));
    std::string resource;
    fields >> resource;
    if (auto inner = resource.find(':'); inner != std::string::npos) resource = resource.substr(inner + 1);
    if (auto dot = resource.rfind('.'); dot != std::string::npos && resource.find('/') < dot) resource.resize(dot);
    if (!resource.empty() && std::find(lanes.begin(), lanes.end(), resource) == lanes.end()) lanes.push_back(resource);
  }
  std::string route = "UCX";
  for (size_t i = 0; i < lanes.size(); ++i) route += (i == 0 ? " " : ", ") + lanes[i];
  return route;
}

TransportCapabilities UcxTransport::capabilities() const {
  // GPU memory needs a UCX built with CUDA (registry.cpp wraps this transport for GPU buffers).
  return {.async_reads = true,
          .maps_peer_memory = shared_memory_,
          .reads_registered_memory = true,
          .host_memory = true,
          .device_memory = false,
          .remote_peers = true};
}

ReadId UcxTransport::post_read(PeerId id, const RemoteRegion& remote, uint64_t remote_offset, void* local,
                               RegionId local_region, uint64_t length, Deadline) {
  Peer& peer = find_peer(id, "reading");
  const std::string what = fmt::format("reading {} bytes from {} (offset {})", length, peer.label, remote_offset);
  const Region& region = find_region(local_region, what);
  const auto* target = static_cast<const std::byte*>(local);
  const auto* base = static_cast<const std::byte*>(region.base);
  if (target < base || length > region.bytes || target - base > static_cast<ptrdiff_t>(region.bytes - length)) {
    fail(ErrorKind::kInvalidArgument, "{}: the local buffer {} lies outside local region {} ({} bytes at {})", what,
         local, local_region, region.bytes, region.base);
  }
  if (remote_offset > remote.length || length > remote.length - remote_offset) {
    fail(ErrorKind::kInvalidArgument, "{}: the remote region holds only {} bytes", what, remote.length);
  }
  PendingRead pending;
  pending.peer = id;
  pending.what = what;
  pending.request = UCS_STATUS_PTR(UCS_OK);
  if (length > 0) {
    check_usable(peer, what);
    ucp_rkey_h rkey = remote_key(peer, remote.key);
    pending.operation = std::make_unique<Operation>(this);
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
    param.cb.send = on_operation_done;
    param.user_data = pending.operation.get();
    param.memh = region.memh;
    pending.request = ucp_get_nbx(peer.ep, local, length, remote.address + remote_offset, rkey, &param);
    // A read from mapped shared memory completes inside ucp_get_nbx; only one left in flight needs
    // the progress thread spinning (a spinner would take a core from the copy itself).
    if (UCS_PTR_IS_PTR(pending.request)) pending.busy = std::make_unique<ProgressThread::Busy>(*progress_);
  }
  std::lock_guard lock(reads_mutex_);
  const ReadId read = next_read_++;
  reads_.emplace(read, std::move(pending));
  return read;
}

UcxTransport::PendingRead UcxTransport::take_read(ReadId read) {
  std::lock_guard lock(reads_mutex_);
  auto it = reads_.find(read);
  if (it == reads_.end()) fail(ErrorKind::kInvalidArgument, "read {} is not a posted read of this transport", read);
  PendingRead pending = std::move(it->second);
  reads_.erase(it);
  return pending;
}

bool UcxTransport::test_read(ReadId read) {
  {
    std::lock_guard lock(reads_mutex_);
    auto it = reads_.find(read);
    if (it == reads_.end()) fail(ErrorKind::kInvalidArgument, "read {} is not a posted read of this transport", read);
    if (UCS_PTR_IS_PTR(it->second.request)) {
      std::lock_guard ucx_lock(mutex_);
      if (!it->second.operation->done) return false;
    }
  }
  wait_read(read, Clock::now());  // complete: frees the request and throws its error
  return true;
}

void UcxTransport::wait_read(ReadId read, Deadline deadline) {
  PendingRead pending = take_read(read);
  Peer& peer = find_peer(pending.peer, "reading");
  finish(peer, pending.request, std::move(pending.operation), deadline, pending.what);
}

void UcxTransport::cancel_read(ReadId read) {
  PendingRead pending = take_read(read);
  if (!UCS_PTR_IS_PTR(pending.request)) return;
  {
    std::lock_guard lock(mutex_);
    if (pending.operation->done) {
      ucp_request_free(pending.request);
      return;
    }
  }
  // UCX cannot cancel a get in flight: closing the endpoint by force completes it (canceled), so
  // that nothing lands in the caller's memory later. Without peer error handling it may.
  Peer& peer = find_peer(pending.peer, "cancelling a read");
  if (options_.error_mode == UCP_ERR_HANDLING_MODE_PEER) {
    peer.timed_out = "cancelled " + pending.what;
    close(peer, true);
  } else {
    spdlog::warn("cancelled {} without peer error handling: it may still complete later", pending.what);
  }
  wait(pending.request, std::move(pending.operation), deadline_after(kCloseTimeout));
}

void UcxTransport::send(PeerId id, std::span<const uint8_t> message, Deadline deadline) {
  Peer& peer = find_peer(id, "sending a message");
  const std::string what = fmt::format("sending a {}-byte message to {}", message.size(), peer.label);
  check_usable(peer, what);

  auto operation = std::make_unique<Operation>(this);
  std::span<const uint8_t> payload = message;
  if (options_.error_mode != UCP_ERR_HANDLING_MODE_PEER) {
    // Without peer error handling a timed-out send cannot be cancelled (see finish()) and may read
    // its buffer after we return: give it a copy that lives as long as the request.
    operation->payload.assign(message.begin(), message.end());
    payload = operation->payload;
  }
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  param.cb.send = on_operation_done;
  param.user_data = operation.get();
  param.memory_type = UCS_MEMORY_TYPE_HOST;
  // The header names this transport, so that the receiver queues the message under its sender.
  ucs_status_ptr_t request =
      ucp_am_send_nbx(peer.ep, kMessageAmId, id_.data(), id_.size(), payload.data(), payload.size(), &param);
  std::optional<ProgressThread::Busy> busy;
  if (UCS_PTR_IS_PTR(request)) busy.emplace(*progress_);
  finish(peer, request, std::move(operation), deadline, what);
}

std::optional<Bytes> UcxTransport::take_message(Peer& peer) {
  std::deque<Inbound>& queue = inbox_[peer.id];
  if (queue.empty() || !queue.front().complete) {
    if (peer.ep == nullptr) fail_closed(peer, "waiting for a message from " + peer.label);
    if (peer.lost)
      fail(ErrorKind::kPeerLost, "lost {} ({}) while waiting for a message from it", peer.label,
           ucs_status_string(peer.lost_status));
    return std::nullopt;
  }
  Inbound message = std::move(queue.front());
  queue.pop_front();
  if (message.status != UCS_OK) {
    fail(is_peer_failure(message.status) ? ErrorKind::kPeerLost : ErrorKind::kTransport,
         "receiving a message from {} failed: {}", peer.label, ucs_status_string(message.status));
  }
  return std::move(message.data);
}

Bytes UcxTransport::receive(PeerId id, Deadline deadline) {
  Peer& peer = find_peer(id, "receiving a message");
  std::unique_lock lock(mutex_);
  std::optional<Bytes> message;
  if (!changed_.wait_until(lock, deadline, [&] { return (message = take_message(peer)).has_value(); }))
    fail(ErrorKind::kTimeout, "timed out waiting for a message from {}", peer.label);
  return std::move(*message);
}

std::optional<Bytes> UcxTransport::try_receive(PeerId id) {
  Peer& peer = find_peer(id, "receiving a message");
  std::lock_guard lock(mutex_);
  return take_message(peer);
}

uint64_t UcxTransport::activity() {
  std::lock_guard lock(mutex_);
  return activity_;
}

void UcxTransport::wait_activity(uint64_t seen, Deadline deadline) {
  std::unique_lock lock(mutex_);
  changed_.wait_until(lock, deadline, [&] { return activity_ != seen; });
}

std::optional<ucs_status_t> UcxTransport::wait(ucs_status_ptr_t request, std::unique_ptr<Operation> operation,
                                               Deadline deadline, const Peer* watched, bool* gone) {
  if (!UCS_PTR_IS_PTR(request)) return UCS_PTR_STATUS(request);
  std::unique_lock lock(mutex_);
  const auto done = [&] { return operation->done; };
  while (!changed_.wait_until(lock, watched ? std::min(deadline, Clock::now() + kLivenessSlice) : deadline, done)) {
    bool dead = false;
    if (!expired(deadline)) {
      if (watched == nullptr) continue;
      lock.unlock();  // reads /proc
      dead = process_is_gone(watched->process);
      lock.lock();
      if (!dead || operation->done) continue;
    }
    if (gone != nullptr) *gone = dead;
    operation->request = request;
    Operation* key = operation.get();
    abandoned_.emplace(key, std::move(operation));
    return std::nullopt;
  }
  const ucs_status_t status = operation->status;
  lock.unlock();
  ucp_request_free(request);
  return status;
}

void UcxTransport::finish(Peer& peer, ucs_status_ptr_t request, std::unique_ptr<Operation> operation, Deadline deadline,
                          const std::string& what) {
  bool gone = false;
  const std::optional<ucs_status_t> status = wait(request, std::move(operation), deadline, &peer, &gone);
  if (!status) {
    // UCX cannot cancel RMA or sends, and a late completion would land in (or read) buffers that
    // the caller reuses or frees. Closing the endpoint by force completes them at once (canceled).
    peer.timed_out = what;
    peer.gone = gone;
    const bool closes = options_.error_mode == UCP_ERR_HANDLING_MODE_PEER;
    if (closes) close(peer, true);
    if (gone) fail_closed(peer, what);
    fail(ErrorKind::kTimeout, "timed out {}{}", what,
         closes ? "; closed the connection so that it cannot complete late"
                : " (without peer error handling it may still complete later)");
  }
  if (*status == UCS_OK) return;
  if (is_lost(peer) || is_peer_failure(*status)) {
    fail(ErrorKind::kPeerLost, "lost {} while {}: {}", peer.label, what, ucs_status_string(*status));
  }
  fail(ErrorKind::kTransport, "UCX failed {}: {}", what, ucs_status_string(*status));
}

void UcxTransport::on_operation_done(void* request, ucs_status_t status, void* user_data) {
  auto* operation = static_cast<Operation*>(user_data);
  UcxTransport* self = operation->owner;
  std::unique_lock lock(self->mutex_);
  if (auto it = self->abandoned_.find(operation); it != self->abandoned_.end()) {
    std::unique_ptr<Operation> abandoned = std::move(it->second);
    self->abandoned_.erase(it);
    lock.unlock();
    ucp_request_free(request);
    return;
  }
  operation->done = true;
  operation->status = status;
  ++self->activity_;
  lock.unlock();
  self->changed_.notify_all();
}

void UcxTransport::on_endpoint_error(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* peer = static_cast<Peer*>(arg);
  // Not a warning: a peer that exits once its work is done (a group shutting down) resets its
  // connections too. A loss that matters fails the operation on that peer, naming it.
  spdlog::debug("UCX connection to {} failed: {}", peer->label, ucs_status_string(status));
  {
    std::lock_guard lock(peer->owner->mutex_);
    peer->lost = true;
    peer->lost_status = status;
    ++peer->owner->activity_;
  }
  peer->owner->changed_.notify_all();
}

ucs_status_t UcxTransport::on_message(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                      const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxTransport*>(arg);
  InstanceId sender;
  try {
    sender = decode_ucx_message_header({static_cast<const uint8_t*>(header), header_length});
  } catch (const Error& e) {
    spdlog::warn("dropping a UCX message not from a refit UCX transport: {}", e.what());
    return UCS_OK;
  }
  const bool rendezvous = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  // Copy or allocate before locking: messages may be tens of MB.
  Bytes bytes;
  if (rendezvous) {
    bytes.resize(length);
  } else {
    bytes.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + length);
  }
  Inbound* message;
  {
    std::lock_guard lock(self->mutex_);
    message = &self->inbox_[sender].emplace_back(Inbound{self, std::move(bytes), !rendezvous, UCS_OK});
    ++self->activity_;
  }
  if (!rendezvous) {
    self->changed_.notify_all();
    return UCS_OK;
  }
  // The receiver does not touch an incomplete message, so its buffer is ours until completion.
  ucp_request_param_t recv{};
  recv.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  recv.cb.recv_am = on_message_data;
  recv.user_data = message;
  recv.memory_type = UCS_MEMORY_TYPE_HOST;
  ucs_status_ptr_t request = ucp_am_recv_data_nbx(self->worker_.get(), data, message->data.data(), length, &recv);
  if (UCS_PTR_IS_PTR(request)) return UCS_INPROGRESS;
  self->complete_inbound(*message, UCS_PTR_STATUS(request));
  return UCS_OK;
}

void UcxTransport::on_message_data(void* request, ucs_status_t status, size_t, void* user_data) {
  auto* message = static_cast<Inbound*>(user_data);
  message->owner->complete_inbound(*message, status);
  ucp_request_free(request);
}

void UcxTransport::complete_inbound(Inbound& message, ucs_status_t status) {
  {
    std::lock_guard lock(mutex_);
    message.complete = true;
    message.status = status;
    ++activity_;
  }
  changed_.notify_all();
}

}  // namespace

std::unique_ptr<Transport> create_ucx_transport(const std::map<std::string, std::string>& init_params,
                                                bool gpu_buffers) {
  return std::make_unique<UcxTransport>(parse_ucx_options(init_params, gpu_buffers));
}

UcxCapabilities ucx_capabilities(const std::map<std::string, std::string>& init_params) {
  UcxCapabilities caps;
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  caps.version = fmt::format("{}.{}.{}", major, minor, release);
  UcpConfig config = make_ucp_config(parse_ucx_options(init_params));
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM;
  ucp_context_h context = nullptr;
  if (ucs_status_t status = ucp_init(&params, config.get(), &context); status != UCS_OK) {
    caps.error = fmt::format("ucp_init: {}", ucs_status_string(status));
    return caps;
  }
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(context, &attr) == UCS_OK) {
    for (int t = 0; t < UCS_MEMORY_TYPE_LAST; ++t)
      if (attr.memory_types & UCS_BIT(t)) caps.memory_types.push_back(ucs_memory_type_names[t]);
    caps.cuda = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  }
  caps.transports = context_resources(context);
  ucp_cleanup(context);
  return caps;
}

}  // namespace refit
