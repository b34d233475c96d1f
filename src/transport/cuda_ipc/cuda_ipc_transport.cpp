#include "transport/cuda_ipc/cuda_ipc_transport.h"

#include "core/fail.h"
#include "refit/device.h"

#ifdef REFIT_HAVE_CUDA

#include <cuda.h>  // driver types only: the driver is reached through cudart's entry points
#include <spdlog/spdlog.h>

#include <cstring>
#include <mutex>

#include "memory/cuda/cuda_util.h"
#include "refit/ext/device_memory.h"
#include "transport/cuda_ipc/cuda_ipc_key.h"
#include "transport/handle_table.h"
#include "transport/local_socket/init_params.h"
#include "transport/local_socket/local_peer.h"
#include "transport/local_socket/local_socket.h"
#include "transport/synchronous_reads.h"

namespace refit {
namespace {

constexpr std::string_view kSocketTag = "cuda-ipc";
constexpr uint8_t kMessages = 0;

static_assert(CUDA_IPC_HANDLE_SIZE == kIpcHandleBytes);

// An IPC handle is 64 opaque bytes (cudaIpcMemHandle_t::reserved): copied as bytes, both ways.
IpcHandleBytes handle_bytes(const cudaIpcMemHandle_t& handle) {
  IpcHandleBytes bytes;
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(handle.reserved[i]);
  return bytes;
}

cudaIpcMemHandle_t ipc_handle(const IpcHandleBytes& bytes) {
  cudaIpcMemHandle_t handle{};
  for (size_t i = 0; i < bytes.size(); ++i) handle.reserved[i] = static_cast<char>(bytes[i]);
  return handle;
}

// The process-wide table of opened IPC handles: a handle may be opened once per process and
// device, and several transports of one process (tests, a process both source and destination)
// may read the same allocation.
class IpcMappings {
 public:
  static IpcMappings& instance() {
    static IpcMappings* mappings = new IpcMappings();  // never destroyed: used from destructors
    return *mappings;
  }

  std::byte* open(const IpcHandleBytes& handle, int device, const std::string& label) {
    std::lock_guard lock(mutex_);
    auto key = std::make_pair(handle, device);
    auto it = open_.find(key);
    if (it != open_.end()) {
      ++it->second.references;
      return it->second.base;
    }
    cuda::DeviceGuard guard(device);
    void* base = nullptr;
    cudaError_t status = cudaIpcOpenMemHandle(&base, ipc_handle(handle), cudaIpcMemLazyEnablePeerAccess);
    if (status != cudaSuccess) {
      cudaGetLastError();
      fail(ErrorKind::kTransport,
           "cannot map a transfer buffer of {} on cuda:{} (cudaIpcOpenMemHandle: {}); CUDA IPC needs both processes on "
           "one host with their GPUs visible to each other",
           label, device, cuda::error_text(status));
    }
    open_.emplace(key, Mapping{static_cast<std::byte*>(base), 1});
    return static_cast<std::byte*>(base);
  }

  void close(const IpcHandleBytes& handle, int device) noexcept {
    std::lock_guard lock(mutex_);
    auto it = open_.find(std::make_pair(handle, device));
    if (it == open_.end() || --it->second.references > 0) return;
    int previous = -1;
    const bool switched =
        cudaGetDevice(&previous) == cudaSuccess && previous != device && cudaSetDevice(device) == cudaSuccess;
    cudaError_t status = cudaIpcCloseMemHandle(it->second.base);
    if (status != cudaSuccess) spdlog::warn("cudaIpcCloseMemHandle: {}", cuda::error_text(status));
    if (switched) cudaSetDevice(previous);
    cudaGetLastError();
    open_.erase(it);
  }

 private:
  struct Mapping {
    std::byte* base = nullptr;
    int references = 0;
  };
  std::mutex mutex_;
  std::map<std::pair<IpcHandleBytes, int>, Mapping> open_;
};

// The GPU that device memory at `pointer` lives on.
int device_of(const void* pointer) {
  cudaPointerAttributes attributes{};
  cuda::check(cudaPointerGetAttributes(&attributes, pointer), "cudaPointerGetAttributes",
              fmt::format("finding the GPU of the memory at {}", pointer));
  if (attributes.device < 0)
    fail(ErrorKind::kTransport, "cudaPointerGetAttributes names no GPU for the device memory at {}", pointer);
  return attributes.device;
}

// A driver function as cudart exposes it (no link against libcuda); null when the driver lacks it.
template <typename Function>
Function driver_function(const char* name) {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found{};
  cudaError_t status = cudaGetDriverEntryPointByVersion(name, &function, 12000, cudaEnableDefault, &found);
  if (status != cudaSuccess || found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Function>(function);
}

// The base and size of the cudaMalloc allocation holding `pointer` (cuMemGetAddressRange). The
// driver looks the pointer up in the calling thread's current context only (another GPU's memory
// is CUDA_ERROR_NOT_FOUND, 500): the caller makes the pointer's GPU current first.
std::pair<std::byte*, size_t> allocation_of(const void* pointer) {
  using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static const auto get_range = driver_function<GetAddressRange>("cuMemGetAddressRange");
  if (get_range == nullptr)
    fail(ErrorKind::kUnsupported,
         "the CUDA driver does not offer cuMemGetAddressRange: cannot register GPU memory for IPC");
  CUdeviceptr base = 0;
  size_t size = 0;
  CUresult result = get_range(&base, &size, reinterpret_cast<CUdeviceptr>(pointer));
  if (result != CUDA_SUCCESS)
    fail(ErrorKind::kTransport, "cuMemGetAddressRange({}) failed with CUDA driver error {}{}", pointer,
         static_cast<int>(result), result == CUDA_ERROR_NOT_FOUND ? " (not an allocation of the current GPU)" : "");
  return {reinterpret_cast<std::byte*>(base), size};
}

// The driver's id of the allocation holding `pointer`, unique for the process's lifetime (an
// allocation freed and made again at the same address gets a new one); 0 when unknown.
uint64_t buffer_id_of(const void* pointer) {
  using GetAttribute = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);
  static const auto get_attribute = driver_function<GetAttribute>("cuPointerGetAttribute");
  unsigned long long id = 0;
  if (get_attribute == nullptr ||
      get_attribute(&id, CU_POINTER_ATTRIBUTE_BUFFER_ID, reinterpret_cast<CUdeviceptr>(pointer)) != CUDA_SUCCESS)
    return 0;
  return id;
}

struct Region {
  std::byte* base = nullptr;
  size_t bytes = 0;
  DeviceBuffer owned;      // set by allocate_memory
  CudaIpcRegionKey key;    // what describe() packs into RemoteRegion::key
  uint64_t buffer_id = 0;  // of the registered allocation (buffer_id_of), to notice it was replaced
};

struct Peer {
  std::string label;
  LocalSocketEndpoint::LinkId link = 0;
  LocalPeerAddress address;
  bool same_process = false;
  struct Mapping {
    std::byte* base = nullptr;  // of the allocation, in our address space
    size_t bytes = 0;           // of the allocation
  };
  std::map<IpcHandleBytes, Mapping> mapped;  // by IPC handle
};

class CudaIpcTransport final : public SynchronousReads {
 public:
  CudaIpcTransport(Device device, double connect_timeout_s)
      : device_(resolve_cuda_device(device)), connect_timeout_s_(connect_timeout_s), control_(kSocketTag) {
    cuda::DeviceGuard guard(device_);
    char bus[32] = {};
    cuda::check(cudaDeviceGetPCIBusId(bus, sizeof(bus), device_), "cudaDeviceGetPCIBusId",
                fmt::format("identifying cuda:{}", device_), ErrorKind::kUnsupported);
    cuda::check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags",
                fmt::format("creating the CUDA IPC copy stream on cuda:{}", device_), ErrorKind::kUnsupported);
    LocalPeerAddress self;
    self.endpoint = control_.id();
    self.identity = local_identity();
    self.device = device_;
    self.bus_id = bus;
    identity_ = self.identity;
    address_ = encode_local_peer_address(kCudaIpcAddressMagic, self);
  }

  ~CudaIpcTransport() override {
    for (auto& [id, peer] : peers_) release_mappings(*peer);
    regions_.clear();
    if (stream_ != nullptr) {
      cuda::DeviceGuard guard(device_);
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
      cudaGetLastError();
    }
  }

  std::string name() const override { return "CUDA_IPC"; }
  TransportCapabilities capabilities() const override {
    return {.async_reads = false,
            .maps_peer_memory = true,
            .maps_registered_memory = true,
            .host_memory = false,
            .device_memory = true,
            .remote_peers = false};
  }

  RegionId register_memory(void* base, size_t bytes) override {
    if (bytes > 0 && base == nullptr)
      fail(ErrorKind::kInvalidArgument, "cannot register {} bytes at a null address with CUDA IPC", bytes);
    Region region;
    region.base = static_cast<std::byte*>(base);
    region.bytes = bytes;
    region.key = self_key();
    if (bytes > 0 && memory_kind_of(base) == MemoryKind::kCuda) {
      // The memory's own GPU, which need not be this transport's nor the current one: the
      // address range and the IPC handle are looked up in its context.
      region.key.device = device_of(base);
      cuda::DeviceGuard guard(region.key.device);  // restores the caller's GPU afterwards
      // Even when it is current already: cudaSetDevice binds its primary context to this thread,
      // which the driver call below needs.
      cuda::check(cudaSetDevice(region.key.device), "cudaSetDevice",
                  fmt::format("selecting cuda:{}, the GPU of the memory at {}", region.key.device, base));
      auto [allocation, allocation_size] = allocation_of(base);
      region.key.offset = static_cast<uint64_t>(region.base - allocation);
      if (region.key.offset + bytes > allocation_size)
        fail(ErrorKind::kInvalidArgument,
             "cannot register {} bytes at {}: the GPU allocation there ends after {} bytes", bytes, base,
             allocation_size - region.key.offset);
      cudaIpcMemHandle_t handle{};
      cuda::check(cudaIpcGetMemHandle(&handle, allocation), "cudaIpcGetMemHandle",
                  fmt::format("exporting {} bytes at {} (memory from cudaMallocAsync pools or cuMemCreate cannot be "
                              "shared with CUDA IPC)",
                              bytes, base));
      region.key.handle = handle_bytes(handle);
      region.key.exported = true;
      region.buffer_id = buffer_id_of(base);
    }
    return add(std::move(region));
  }

  Extent registration_extent(const std::byte* base, size_t bytes) const override {
    if (bytes == 0 || memory_kind_of(base) != MemoryKind::kCuda) return {base, bytes};
    const int device = device_of(base);
    cuda::DeviceGuard guard(device);
    cuda::check(cudaSetDevice(device), "cudaSetDevice",
                fmt::format("selecting cuda:{}, the GPU of the memory at {}", device, static_cast<const void*>(base)));
    auto [allocation, allocation_size] = allocation_of(base);
    return {allocation, allocation_size};
  }

  bool registration_current(RegionId id) const override {
    const Region& r = find_region(id, "checking a registration");
    if (r.buffer_id == 0) return true;  // nothing to compare with (host memory, an old driver)
    cuda::DeviceGuard guard(r.key.device);
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, r.base) != cudaSuccess || attributes.type != cudaMemoryTypeDevice) {
      cudaGetLastError();
      return false;  // freed
    }
    return buffer_id_of(r.base) == r.buffer_id;
  }

  Allocation allocate_memory(size_t bytes) override {
    Region region;
    region.owned = DeviceBuffer(Device{Device::Kind::kCuda, device_}, bytes);
    region.base = region.owned.data();
    region.bytes = bytes;
    region.key = self_key();
    if (bytes > 0) {
      cuda::DeviceGuard guard(device_);
      cudaIpcMemHandle_t handle{};
      cuda::check(cudaIpcGetMemHandle(&handle, region.base), "cudaIpcGetMemHandle",
                  fmt::format("exporting a {}-byte transfer buffer on cuda:{}", bytes, device_));
      region.key.handle = handle_bytes(handle);
      region.key.exported = true;
    }
    std::byte* base = region.base;
    RegionId id = add(std::move(region));
    return {id, base};
  }

  RemoteRegion describe(RegionId id) const override {
    const Region& r = find_region(id, "describing a region");
    return {reinterpret_cast<uint64_t>(r.base), r.bytes, encode_cuda_ipc_key(r.key)};
  }

  void deregister_memory(RegionId id) override {
    regions_.take(id, "deregistering a region");  // frees an allocation (DeviceBuffer)
  }

  Bytes address() const override { return address_; }

  PeerId connect(std::span<const uint8_t> peer_address, const std::string& label) override {
    LocalPeerAddress remote = decode_local_peer_address(kCudaIpcAddressMagic, "CUDA_IPC", peer_address, label);
    if (remote.identity.host != identity_.host) {
      fail(ErrorKind::kTransport,
           "CUDA IPC needs both peers on one host: {} runs on host '{}', this process on '{}'; use backend_name NCCL "
           "or UCX between hosts",
           label, remote.identity.host, identity_.host);
    }
    auto peer = std::make_unique<Peer>();
    peer->label = label;
    peer->address = remote;
    peer->same_process = remote.identity.process == identity_.process && remote.identity.pid == identity_.pid;
    peer->link = control_.connect(remote.endpoint, kSocketTag, label,
                                  deadline_after(std::chrono::duration<double>(connect_timeout_s_)));
    return peers_.add(std::move(peer));
  }

  void disconnect(PeerId id) override {
    std::unique_ptr<Peer> peer = peers_.take(id, "disconnecting");
    release_mappings(*peer);
    control_.disconnect(peer->link);
  }

  void read_now(PeerId id, const RemoteRegion& remote, uint64_t remote_offset, void* local, RegionId local_region,
                uint64_t length, Deadline deadline) override {
    Peer& peer = find_peer(id, "reading");
    const std::string what = fmt::format("reading {} bytes from {} (offset {})", length, peer.label, remote_offset);
    const Region& region = find_region(local_region, what);
    const auto* target = static_cast<const std::byte*>(local);
    if (target < region.base || length > region.bytes ||
        target - region.base > static_cast<ptrdiff_t>(region.bytes - length)) {
      fail(ErrorKind::kInvalidArgument, "{}: the local buffer {} lies outside local region {} ({} bytes at {})", what,
           local, local_region, region.bytes, static_cast<void*>(region.base));
    }
    if (remote_offset > remote.length || length > remote.length - remote_offset)
      fail(ErrorKind::kInvalidArgument, "{}: the remote region holds only {} bytes", what, remote.length);
    if (length == 0) return;
    control_.check_alive(peer.link, what);
    const std::byte* source = remote_base(peer, remote, what) + remote_offset;
    cuda::DeviceGuard guard(device_);
    cuda::check(cudaMemcpyAsync(local, source, length, cudaMemcpyDefault, stream_), "cudaMemcpyAsync", what);
    cuda::wait_stream(stream_, deadline, what);
  }

  const std::byte* map(PeerId id, const RemoteRegion& remote) override {
    Peer& peer = find_peer(id, "mapping a region");
    return remote_base(peer, remote, fmt::format("mapping a region of {}", peer.label));
  }

  void send(PeerId id, std::span<const uint8_t> message, Deadline deadline) override {
    control_.send(find_peer(id, "sending a message").link, kMessages, message, deadline);
  }

  Bytes receive(PeerId id, Deadline deadline) override {
    return control_.receive(find_peer(id, "receiving a message").link, kMessages, deadline);
  }
  std::optional<Bytes> try_receive(PeerId id) override {
    return control_.try_receive(find_peer(id, "receiving a message").link, kMessages);
  }
  uint64_t activity() override { return control_.activity(); }
  void wait_activity(uint64_t seen, Deadline deadline) override { control_.wait_activity(seen, deadline); }

 private:
  CudaIpcRegionKey self_key() const {
    CudaIpcRegionKey key;
    key.owner = control_.id();
    key.process = identity_.process;
    key.device = device_;
    return key;
  }

  RegionId add(Region region) { return regions_.add(std::move(region)); }
  const Region& find_region(RegionId id, std::string_view doing) const { return regions_.find(id, doing); }
  Peer& find_peer(PeerId id, std::string_view doing) { return *peers_.find(id, doing); }

  // Where the remote region starts in our address space.
  const std::byte* remote_base(Peer& peer, const RemoteRegion& remote, const std::string& what) {
    const CudaIpcRegionKey key = decode_cuda_ipc_key(remote.key, peer.label);
    if (key.owner != peer.address.endpoint)
      fail(ErrorKind::kProtocol, "{}: the region was described by another endpoint than {}", what, peer.label);
    if (!key.exported) {
      fail(ErrorKind::kUnsupported,
           "{}: the region lives in host memory of {}, which CUDA IPC cannot map; use device "
           "memory (allocate_memory) or backend_name UCX",
           what, peer.label);
    }
    if (peer.same_process) return reinterpret_cast<const std::byte*>(remote.address);
    auto it = peer.mapped.find(key.handle);
    if (it == peer.mapped.end()) {
      std::byte* base = IpcMappings::instance().open(key.handle, device_, peer.label);
      cuda::DeviceGuard guard(device_);  // the mapping lives in our GPU's context
      it = peer.mapped.emplace(key.handle, Peer::Mapping{base, allocation_of(base).second}).first;
    }
    // The key and the length come from the peer: the region must lie inside what was mapped.
    const size_t bytes = it->second.bytes;
    if (key.offset > bytes || remote.length > bytes - key.offset)
      fail(ErrorKind::kProtocol, "{}: {} describes {} bytes at offset {} of a GPU allocation of {} bytes", what,
           peer.label, remote.length, key.offset, bytes);
    return it->second.base + key.offset;
  }

  void release_mappings(Peer& peer) noexcept {
    for (auto& [handle, mapping] : peer.mapped) IpcMappings::instance().close(handle, device_);
    peer.mapped.clear();
  }

  int device_;
  double connect_timeout_s_;
  LocalSocketEndpoint control_;
  LocalIdentity identity_;
  Bytes address_;
  cudaStream_t stream_ = nullptr;
  HandleTable<Region> regions_{"CUDA IPC", "region", "registered"};
  HandleTable<std::unique_ptr<Peer>> peers_{"CUDA IPC", "peer", "connected"};
};

}  // namespace

std::unique_ptr<Transport> create_cuda_ipc_transport(const std::map<std::string, std::string>& init_params) {
  InitParams params("CUDA_IPC", init_params);
  Device device = parse_gpu_device_param("CUDA_IPC", params.get("device", "cuda"));
  double connect_timeout_s = params.seconds("connect_timeout_s", 30.0);
  params.finish();
  return std::make_unique<CudaIpcTransport>(device, connect_timeout_s);
}

}  // namespace refit

#else  // no CUDA in this build

namespace refit {

std::unique_ptr<Transport> create_cuda_ipc_transport(const std::map<std::string, std::string>&) {
  fail(ErrorKind::kUnsupported,
       "backend_name CUDA_IPC needs CUDA, and this build has no CUDA support; rebuild with REFIT_WITH_CUDA=ON or use "
       "backend_name UCX with device=cpu");
}

}  // namespace refit

#endif  // REFIT_HAVE_CUDA
