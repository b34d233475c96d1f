// A transport backend written in Python (refit.nixl.NixlTransport): the engine's refit::Transport
// calls, forwarded to a Python object whose methods never block.
//
// Why the waits live here and not in Python: the engine runs with the GIL released, and a Python
// loop that waited for a read or a message would hold the GIL for the whole wait (stalling every
// other Python thread of the process, Ray's included). Here each poll takes the GIL for one call,
// and the time between polls is spent without it. Every wait has the engine's deadline.
//
// The object's methods (all return at once):
//   name() -> str                       capabilities() -> dict of TransportCapabilities fields
//   register(address, length, device) -> int region       device: -1 host memory, else a GPU index
//   describe(region) -> bytes key       deregister(region)
//   address() -> bytes                  connect(address: bytes, label: str) -> int peer
//   disconnect(peer)                    route(peer) -> str
//   post_read(peer, key, remote_address, local_address, local_region, length) -> int read
//   post_reads(peer, [(key, remote_address, local_address, length)], local_region) -> int read
//                                       (optional: one read of many ranges; batched_reads)
//   test_read(read) -> bool             cancel_read(read)
//   send(peer, message: bytes)          poll(peer) -> bytes | None (the next message, if one came)
// A refit exception (refit.PeerLostError, ...) raised by a method keeps its kind; any other
// exception becomes a TransportError with the method and the exception's text.

#include <nanobind/stl/string.h>

#include <chrono>
#include <map>
#include <thread>

#include "common.h"
#include "refit/device.h"
#include "refit/ext/device_buffers.h"
#include "refit/ext/transport.h"
#include "refit/memory.h"

namespace refit::py {
namespace {

// Polling: a few yields first (a read or message that is about to land), then short sleeps, so
// that a long wait costs little CPU while a short one adds little latency.
class Backoff {
 public:
  void pause() {
    if (++rounds_ < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(rounds_ < 1024 ? 20 : 200));
    }
  }

 private:
  int rounds_ = 0;
};

ErrorKind kind_of(nb::handle exception) {
  for (int k = 0; k <= static_cast<int>(ErrorKind::kInternal); ++k) {
    const auto kind = static_cast<ErrorKind>(k);
    nb::handle type = error_type(kind);
    if (type.is_valid() && PyObject_IsInstance(exception.ptr(), type.ptr()) == 1) return kind;
  }
  PyErr_Clear();
  return ErrorKind::kTransport;
}

class PythonTransport final : public Transport {
 public:
  PythonTransport(nb::object impl, std::string name, const Device& device)
      : impl_(std::move(impl)), name_(std::move(name)), device_(device) {
    nb::dict caps = nb::cast<nb::dict>(impl_.attr("capabilities")());
    auto flag = [&](const char* key) { return caps.contains(key) && nb::cast<bool>(caps[key]); };
    caps_.async_reads = true;
    caps_.host_memory = flag("host_memory");
    caps_.device_memory = flag("device_memory");
    caps_.remote_peers = flag("remote_peers");
    caps_.reads_registered_memory = flag("reads_registered_memory");
    caps_.batched_reads = nb::hasattr(impl_, "post_reads");
  }

  ~PythonTransport() override {
    if (interpreter_finalizing()) {
      impl_.release();  // Python is going away: calling into it now would crash
      return;
    }
    nb::gil_scoped_acquire gil;
    for (auto& [region, buffer] : owned_) call_quietly("deregister", region);
    owned_.clear();
    impl_.reset();
  }

  std::string name() const override { return name_; }
  TransportCapabilities capabilities() const override { return caps_; }

  RegionId register_memory(void* base, size_t bytes) override {
    int device = -1;
    if (memory_kind_of(base) == MemoryKind::kCuda)
      device = resolve_cuda_device(device_.kind == Device::Kind::kCuda ? device_ : Device{Device::Kind::kCuda, -1});
    const auto region = call<RegionId>("register", reinterpret_cast<uintptr_t>(base), bytes, device);
    regions_[region] = RemoteRegion{reinterpret_cast<uintptr_t>(base), bytes, {}};
    return region;
  }

  Allocation allocate_memory(size_t bytes) override {
    HostBuffer buffer(bytes);
    std::byte* base = buffer.data();
    const RegionId region = register_memory(base, bytes);
    owned_.emplace(region, std::move(buffer));
    return {region, base};
  }

  RemoteRegion describe(RegionId region) const override {
    const auto it = regions_.find(region);
    if (it == regions_.end()) throw Error(ErrorKind::kInvalidArgument, fmt::format("{}: no region {}", name_, region));
    RemoteRegion out = it->second;
    nb::gil_scoped_acquire gil;
    out.key = bytes_from(guarded("describe", [&] { return impl_.attr("describe")(region); }));
    return out;
  }

  void deregister_memory(RegionId region) override {
    call<void>("deregister", region);
    regions_.erase(region);
    owned_.erase(region);
  }

  Bytes address() const override {
    nb::gil_scoped_acquire gil;
    return bytes_from(guarded("address", [&] { return impl_.attr("address")(); }));
  }

  PeerId connect(std::span<const uint8_t> peer_address, const std::string& label) override {
    nb::gil_scoped_acquire gil;
    nb::bytes blob(reinterpret_cast<const char*>(peer_address.data()), peer_address.size());
    const auto peer = nb::cast<PeerId>(guarded("connect", [&] { return impl_.attr("connect")(blob, label); }));
    labels_[peer] = label;
    return peer;
  }

  void disconnect(PeerId peer) override {
    call<void>("disconnect", peer);
    labels_.erase(peer);
  }

  std::string route(PeerId peer) override { return call<std::string>("route", peer); }

  // Throws Error(kInvalidArgument) unless [remote_offset, +length) lies in the peer's region.
  void check_range(const RemoteRegion& remote, uint64_t remote_offset, uint64_t length) const {
    if (remote_offset > remote.length || length > remote.length - remote_offset)
      throw Error(ErrorKind::kInvalidArgument,
                  fmt::format("{}: read of {} bytes at offset {} is outside the peer's region of {} bytes", name_,
                              length, remote_offset, remote.length));
  }

  ReadId post_read(PeerId peer, const RemoteRegion& remote, uint64_t remote_offset, void* local, RegionId local_region,
                   uint64_t length, Deadline) override {
    check_range(remote, remote_offset, length);
    nb::gil_scoped_acquire gil;
    nb::bytes key(reinterpret_cast<const char*>(remote.key.data()), remote.key.size());
    return nb::cast<ReadId>(guarded("post_read", [&] {
      return impl_.attr("post_read")(peer, key, remote.address + remote_offset, reinterpret_cast<uintptr_t>(local),
                                     local_region, length);
    }));
  }

  ReadId post_reads(PeerId peer, std::span<const ReadRange> ranges, RegionId local_region, Deadline) override {
    nb::gil_scoped_acquire gil;
    nb::list list;
    for (const ReadRange& r : ranges) {
      check_range(*r.remote, r.remote_offset, r.length);
      list.append(nb::make_tuple(nb::bytes(reinterpret_cast<const char*>(r.remote->key.data()), r.remote->key.size()),
                                 r.remote->address + r.remote_offset, reinterpret_cast<uintptr_t>(r.local), r.length));
    }
    return nb::cast<ReadId>(guarded("post_reads", [&] { return impl_.attr("post_reads")(peer, list, local_region); }));
  }

  bool test_read(ReadId read) override { return call<bool>("test_read", read); }

  void wait_read(ReadId read, Deadline deadline) override {
    Backoff backoff;
    while (!test_read(read)) {
      if (expired(deadline)) {
        cancel_read(read);
        throw Error(ErrorKind::kTimeout, fmt::format("{}: a read did not complete by its deadline", name_));
      }
      backoff.pause();
    }
  }

  void cancel_read(ReadId read) override { call<void>("cancel_read", read); }

  void send(PeerId peer, std::span<const uint8_t> message, Deadline) override {
    nb::gil_scoped_acquire gil;
    nb::bytes blob(reinterpret_cast<const char*>(message.data()), message.size());
    guarded("send", [&] { return impl_.attr("send")(peer, blob); });
  }

  std::optional<Bytes> try_receive(PeerId peer) override {
    nb::gil_scoped_acquire gil;
    nb::object message = guarded("poll", [&] { return impl_.attr("poll")(peer); });
    if (message.is_none()) return std::nullopt;
    return bytes_from(message);
  }

  Bytes receive(PeerId peer, Deadline deadline) override {
    Backoff backoff;
    for (;;) {
      if (auto message = try_receive(peer)) return std::move(*message);
      if (expired(deadline))
        throw Error(ErrorKind::kTimeout, fmt::format("{}: no message from {} by the deadline", name_, label(peer)));
      backoff.pause();
    }
  }

 private:
  // Runs `body` (a call into the Python object; the GIL is held) and turns a Python exception
  // into refit::Error: a refit exception keeps its kind and message, another becomes kTransport.
  template <typename Body>
  nb::object guarded(const char* method, Body&& body) const {
    try {
      return body();
    } catch (nb::python_error& e) {
      const ErrorKind kind = kind_of(e.value());
      std::string text = nb::cast<std::string>(nb::str(e.value()));
      if (kind == ErrorKind::kTransport && !PyObject_IsInstance(e.value().ptr(), error_type(kind).ptr())) {
        text = fmt::format("{} {}: {}: {}", name_, method, Py_TYPE(e.value().ptr())->tp_name, text);
      }
      PyErr_Clear();
      throw Error(kind, text);
    } catch (nb::cast_error& e) {
      throw Error(ErrorKind::kInternal, fmt::format("{} {}: unexpected result type: {}", name_, method, e.what()));
    }
  }

  template <typename Result, typename... Args>
  Result call(const char* method, Args... args) const {
    nb::gil_scoped_acquire gil;
    nb::object result = guarded(method, [&] { return impl_.attr(method)(args...); });
    if constexpr (!std::is_void_v<Result>) {
      try {
        return nb::cast<Result>(result);
      } catch (nb::cast_error& e) {
        throw Error(ErrorKind::kInternal, fmt::format("{} {}: unexpected result type", name_, method));
      }
    }
  }

  template <typename... Args>
  void call_quietly(const char* method, Args... args) noexcept {
    try {
      impl_.attr(method)(args...);
    } catch (...) {
      PyErr_Clear();  // teardown: the object releases what it holds with itself anyway
    }
  }

  static Bytes bytes_from(nb::handle value) {
    if (!PyBytes_Check(value.ptr())) throw Error(ErrorKind::kInternal, "transport method returned no bytes");
    const auto* data = reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(value.ptr()));
    return Bytes(data, data + PyBytes_GET_SIZE(value.ptr()));
  }

  std::string label(PeerId peer) const {
    const auto it = labels_.find(peer);
    return it == labels_.end() ? fmt::format("peer {}", peer) : it->second;
  }

  nb::object impl_;
  const std::string name_;
  const Device device_;
  TransportCapabilities caps_;
  std::map<RegionId, RemoteRegion> regions_;  // address and length of what we registered (the key is the object's)
  std::map<RegionId, HostBuffer> owned_;      // host transfer buffers from allocate_memory
  std::map<PeerId, std::string> labels_;
};

}  // namespace

std::shared_ptr<Transport> python_transport(nb::handle impl, const Device& device) {
  std::string name = nb::cast<std::string>(impl.attr("name")());
  std::unique_ptr<Transport> transport = std::make_unique<PythonTransport>(nb::borrow(impl), std::move(name), device);
  // GPU transfer buffers: allocated here and registered as device memory with the Python backend.
  if (device.kind == Device::Kind::kCuda) transport = with_device_buffers(std::move(transport), device);
  return transport;
}

}  // namespace refit::py
