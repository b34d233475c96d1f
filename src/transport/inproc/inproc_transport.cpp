#include "transport/inproc/inproc_transport.h"

#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>

#include "core/fail.h"
#include "core/wire.h"
#include "refit/memory.h"
#include "transport/synchronous_reads.h"

namespace refit {

struct InProcRegion {
  std::byte* base = nullptr;
  size_t bytes = 0;
  std::shared_ptr<HostBuffer> owned;  // set for allocate_memory()
};

struct InProcEndpoint {
  std::map<RegionId, InProcRegion> regions;
  std::map<uint64_t, std::deque<Bytes>> inbox;  // by sender endpoint id
  // Its owner waits here, so that a message wakes its receiver only, not every endpoint.
  std::condition_variable changed;
  uint64_t activity = 0;  // moves with every notify of `changed`
};

class InProcFabric {
 public:
  std::mutex mutex;
  std::map<uint64_t, InProcEndpoint> endpoints;  // live endpoints by id
  uint64_t next_id = 1;
};

namespace {

// Addresses and region keys are one u64 id each.
Bytes id_bytes(uint64_t id) {
  ByteWriter w;
  w.put<uint64_t>(id);
  return w.take();
}

uint64_t id_from(std::span<const uint8_t> b, const char* what) {
  ByteReader r(b, fmt::format("in-process {}", what));
  const auto id = r.get<uint64_t>("id");
  r.expect_end();
  return id;
}

class InProcTransport final : public SynchronousReads {
 public:
  explicit InProcTransport(std::shared_ptr<InProcFabric> fabric) : fabric_(std::move(fabric)) {
    std::lock_guard lock(fabric_->mutex);
    id_ = fabric_->next_id++;
    fabric_->endpoints[id_];
  }

  ~InProcTransport() override {
    std::lock_guard lock(fabric_->mutex);
    fabric_->endpoints.erase(id_);
    // Whoever waits for this endpoint's messages learns that it is gone.
    for (auto& [id, endpoint] : fabric_->endpoints) {
      ++endpoint.activity;
      endpoint.changed.notify_all();
    }
  }

  std::string name() const override { return "INPROC"; }
  TransportCapabilities capabilities() const override {
    return {.async_reads = false,
            .maps_peer_memory = true,
            .maps_registered_memory = true,
            .reads_registered_memory = true,
            .host_memory = true,
            .device_memory = false,
            .remote_peers = false};
  }

  RegionId register_memory(void* base, size_t bytes) override {
    std::lock_guard lock(fabric_->mutex);
    RegionId id = next_region_++;
    self().regions[id] = {static_cast<std::byte*>(base), bytes, nullptr};
    return id;
  }

  Allocation allocate_memory(size_t bytes) override {
    auto buffer = std::make_shared<HostBuffer>(bytes);
    std::lock_guard lock(fabric_->mutex);
    RegionId id = next_region_++;
    self().regions[id] = {buffer->data(), bytes, buffer};
    return {id, buffer->data()};
  }

  RemoteRegion describe(RegionId region) const override {
    std::lock_guard lock(fabric_->mutex);
    const auto& r = region_of(fabric_->endpoints.at(id_), region, "local endpoint");
    return {reinterpret_cast<uint64_t>(r.base), r.bytes, id_bytes(region)};
  }

  void deregister_memory(RegionId region) override {
    std::lock_guard lock(fabric_->mutex);
    self().regions.erase(region);
  }

  Bytes address() const override { return id_bytes(id_); }

  PeerId connect(std::span<const uint8_t> peer_address, const std::string& label) override {
    uint64_t peer = id_from(peer_address, "address");
    std::lock_guard lock(fabric_->mutex);
    if (!fabric_->endpoints.count(peer)) fail(ErrorKind::kPeerLost, "cannot connect to {}: no such endpoint", label);
    labels_[peer] = label;
    return peer;
  }

  void disconnect(PeerId peer) override {
    std::lock_guard lock(fabric_->mutex);
    labels_.erase(peer);
  }

  void read_now(PeerId peer, const RemoteRegion& remote, uint64_t remote_offset, void* local, RegionId local_region,
                uint64_t length, Deadline) override {
    std::lock_guard lock(fabric_->mutex);
    auto& target = live_peer(peer, "read");
    const auto& region = region_of(target, id_from(remote.key, "region key"), label(peer));
    if (remote_offset > region.bytes || length > region.bytes - remote_offset)
      fail(ErrorKind::kTransport, "read of {} bytes at offset {} is outside the {}-byte region of {}", length,
           remote_offset, region.bytes, label(peer));
    const auto& mine = region_of(self(), local_region, "local endpoint");
    auto* dst = static_cast<std::byte*>(local);
    if (dst < mine.base || dst + length > mine.base + mine.bytes)
      fail(ErrorKind::kTransport, "read target lies outside the local registered region");
    std::memcpy(dst, region.base + remote_offset, length);
  }

  const std::byte* map(PeerId peer, const RemoteRegion& remote) override {
    std::lock_guard lock(fabric_->mutex);
    auto& target = live_peer(peer, "map");
    return region_of(target, id_from(remote.key, "region key"), label(peer)).base;
  }

  void send(PeerId peer, std::span<const uint8_t> message, Deadline) override {
    std::lock_guard lock(fabric_->mutex);
    InProcEndpoint& receiver = live_peer(peer, "send");
    receiver.inbox[id_].emplace_back(message.begin(), message.end());
    ++receiver.activity;
    receiver.changed.notify_all();
  }

  std::optional<Bytes> try_receive(PeerId peer) override {
    std::lock_guard lock(fabric_->mutex);
    return take_message(peer);
  }

  uint64_t activity() override {
    std::lock_guard lock(fabric_->mutex);
    return self().activity;
  }

  void wait_activity(uint64_t seen, Deadline deadline) override {
    std::unique_lock lock(fabric_->mutex);
    self().changed.wait_until(lock, deadline, [&] { return self().activity != seen; });
  }

  Bytes receive(PeerId peer, Deadline deadline) override {
    std::unique_lock lock(fabric_->mutex);
    std::optional<Bytes> message;
    if (!self().changed.wait_until(lock, deadline, [&] { return (message = take_message(peer)).has_value(); }))
      fail(ErrorKind::kTimeout, "no message from {} before the deadline", label(peer));
    return std::move(*message);
  }

 private:
  // The next message from `peer`, if one is here; throws once the peer is gone and nothing it
  // sent is left. Under the fabric's mutex.
  std::optional<Bytes> take_message(PeerId peer) {
    auto& queue = self().inbox[peer];
    if (queue.empty()) {
      if (!fabric_->endpoints.count(peer))
        fail(ErrorKind::kPeerLost, "lost {} while waiting for a message", label(peer));
      return std::nullopt;
    }
    Bytes m = std::move(queue.front());
    queue.pop_front();
    return m;
  }

  InProcEndpoint& self() { return fabric_->endpoints.at(id_); }

  std::string label(PeerId peer) const {
    auto it = labels_.find(peer);
    return it == labels_.end() ? fmt::format("in-process endpoint {}", peer) : it->second;
  }

  InProcEndpoint& live_peer(PeerId peer, const char* op) {
    auto it = fabric_->endpoints.find(peer);
    if (it == fabric_->endpoints.end()) fail(ErrorKind::kPeerLost, "lost {} during {}", label(peer), op);
    return it->second;
  }

  static const InProcRegion& region_of(const InProcEndpoint& ep, RegionId region, const std::string& owner) {
    auto it = ep.regions.find(region);
    if (it == ep.regions.end()) fail(ErrorKind::kTransport, "region {} of {} is not registered", region, owner);
    return it->second;
  }

  std::shared_ptr<InProcFabric> fabric_;
  uint64_t id_ = 0;
  RegionId next_region_ = 1;
  std::map<PeerId, std::string> labels_;
};

}  // namespace

std::shared_ptr<InProcFabric> make_inproc_fabric() { return std::make_shared<InProcFabric>(); }

std::unique_ptr<Transport> create_inproc_transport(std::shared_ptr<InProcFabric> fabric) {
  return std::make_unique<InProcTransport>(std::move(fabric));
}

}  // namespace refit
