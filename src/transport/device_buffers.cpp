#include "refit/ext/device_buffers.h"

#include <map>

#include "core/fail.h"
#include "refit/device.h"
#include "refit/ext/device_memory.h"

namespace refit {
namespace {

class DeviceBufferTransport final : public Transport {
 public:
  DeviceBufferTransport(std::unique_ptr<Transport> inner, const Device& device)
      : inner_(std::move(inner)), device_(device) {}

  ~DeviceBufferTransport() override {
    // Deregister before the buffers go: the inner transport must not keep GPU memory mapped.
    for (auto& [region, buffer] : owned_) {
      try {
        inner_->deregister_memory(region);
      } catch (const std::exception&) {
        // The inner transport releases its registrations with itself anyway.
      }
    }
    inner_.reset();
    owned_.clear();
  }

  std::string name() const override { return inner_->name(); }
  RegionId register_memory(void* base, size_t bytes) override { return inner_->register_memory(base, bytes); }

  Allocation allocate_memory(size_t bytes) override {
    DeviceBuffer buffer(device_, bytes);
    RegionId region = inner_->register_memory(buffer.data(), bytes);
    std::byte* base = buffer.data();
    owned_.emplace(region, std::move(buffer));
    return {region, base};
  }

  RemoteRegion describe(RegionId region) const override { return inner_->describe(region); }

  void deregister_memory(RegionId region) override {
    inner_->deregister_memory(region);
    owned_.erase(region);
  }

  Bytes address() const override { return inner_->address(); }
  PeerId connect(std::span<const uint8_t> peer_address, const std::string& label) override {
    return inner_->connect(peer_address, label);
  }
  void disconnect(PeerId peer) override { inner_->disconnect(peer); }
  TransportCapabilities capabilities() const override { return inner_->capabilities(); }
  std::string route(PeerId peer) override { return inner_->route(peer); }
  ReadId post_read(PeerId peer, const RemoteRegion& remote, uint64_t remote_offset, void* local, RegionId local_region,
                   uint64_t length, Deadline deadline) override {
    return inner_->post_read(peer, remote, remote_offset, local, local_region, length, deadline);
  }
  ReadId post_reads(PeerId peer, std::span<const ReadRange> ranges, RegionId local_region, Deadline deadline) override {
    return inner_->post_reads(peer, ranges, local_region, deadline);
  }
  bool test_read(ReadId read) override { return inner_->test_read(read); }
  void wait_read(ReadId read, Deadline deadline) override { inner_->wait_read(read, deadline); }
  void cancel_read(ReadId read) override { inner_->cancel_read(read); }
  const std::byte* map(PeerId peer, const RemoteRegion& remote) override { return inner_->map(peer, remote); }
  void send(PeerId peer, std::span<const uint8_t> message, Deadline deadline) override {
    inner_->send(peer, message, deadline);
  }
  Bytes receive(PeerId peer, Deadline deadline) override { return inner_->receive(peer, deadline); }
  std::optional<Bytes> try_receive(PeerId peer) override { return inner_->try_receive(peer); }
  uint64_t activity() override { return inner_->activity(); }
  void wait_activity(uint64_t seen, Deadline deadline) override { inner_->wait_activity(seen, deadline); }

 private:
  std::unique_ptr<Transport> inner_;
  Device device_;
  std::map<RegionId, DeviceBuffer> owned_;
};

}  // namespace

std::unique_ptr<Transport> with_device_buffers(std::unique_ptr<Transport> inner, const Device& device) {
  return std::make_unique<DeviceBufferTransport>(std::move(inner), device);
}

}  // namespace refit
