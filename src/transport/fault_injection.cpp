#include "transport/fault_injection.h"

#include <spdlog/spdlog.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

#include "core/fail.h"

namespace refit {
namespace {

class FlipReadBytes final : public Transport {
 public:
  FlipReadBytes(std::unique_ptr<Transport> inner, uint64_t every) : inner_(std::move(inner)), every_(every) {}

  std::string name() const override { return inner_->name(); }
  RegionId register_memory(void* base, size_t bytes) override { return inner_->register_memory(base, bytes); }
  Allocation allocate_memory(size_t bytes) override { return inner_->allocate_memory(bytes); }
  RemoteRegion describe(RegionId region) const override { return inner_->describe(region); }
  void deregister_memory(RegionId region) override { inner_->deregister_memory(region); }
  Bytes address() const override { return inner_->address(); }
  PeerId connect(std::span<const uint8_t> address, const std::string& label) override {
    return inner_->connect(address, label);
  }
  void disconnect(PeerId peer) override { inner_->disconnect(peer); }
  void send(PeerId peer, std::span<const uint8_t> message, Deadline deadline) override {
    inner_->send(peer, message, deadline);
  }
  Bytes receive(PeerId peer, Deadline deadline) override { return inner_->receive(peer, deadline); }
  std::optional<Bytes> try_receive(PeerId peer) override { return inner_->try_receive(peer); }
  uint64_t activity() override { return inner_->activity(); }
  void wait_activity(uint64_t seen, Deadline deadline) override { inner_->wait_activity(seen, deadline); }

  // It maps nothing (map() is null), so that every byte goes through read().
  TransportCapabilities capabilities() const override {
    TransportCapabilities caps = inner_->capabilities();
    caps.maps_peer_memory = caps.maps_registered_memory = false;
    caps.batched_reads = false;  // each read is watched on its own
    return caps;
  }
  std::string route(PeerId peer) override { return inner_->route(peer); }
  ReadId post_read(PeerId peer, const RemoteRegion& remote, uint64_t remote_offset, void* local, RegionId local_region,
                   uint64_t length, Deadline deadline) override {
    const ReadId id = inner_->post_read(peer, remote, remote_offset, local, local_region, length, deadline);
    std::lock_guard lock(mutex_);
    pending_[id] = {static_cast<uint8_t*>(local), length};
    return id;
  }
  bool test_read(ReadId read) override {
    if (!inner_->test_read(read)) return false;
    completed(read);
    return true;
  }
  void wait_read(ReadId read, Deadline deadline) override {
    inner_->wait_read(read, deadline);
    completed(read);
  }
  void cancel_read(ReadId read) override {
    inner_->cancel_read(read);
    std::lock_guard lock(mutex_);
    pending_.erase(read);
  }

 private:
  // Flips one byte of every `every_`-th completed read.
  void completed(ReadId read) {
    std::lock_guard lock(mutex_);
    auto it = pending_.find(read);
    if (it == pending_.end()) return;
    const auto [bytes, length] = it->second;
    pending_.erase(it);
    if (length > 0 && ++reads_ % every_ == 0) bytes[(reads_ * 7919) % length] ^= 0x5a;
  }

  std::unique_ptr<Transport> inner_;
  uint64_t every_;
  std::mutex mutex_;
  std::map<ReadId, std::pair<uint8_t*, uint64_t>> pending_;
  uint64_t reads_ = 0;
};

}  // namespace

std::unique_ptr<Transport> flip_read_bytes(std::unique_ptr<Transport> inner, uint64_t every) {
  if (every == 0) fail(ErrorKind::kInvalidArgument, "flip_read_bytes: every must be >= 1");
  return std::make_unique<FlipReadBytes>(std::move(inner), every);
}

std::unique_ptr<Transport> maybe_inject_faults(std::unique_ptr<Transport> transport) {
  const char* every = std::getenv("REFIT_TEST_FLIP_READ_BYTES");
  if (every == nullptr || *every == '\0') return transport;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(every, &end, 10);
  if (*end != '\0' || n == 0)
    fail(ErrorKind::kConfig, "REFIT_TEST_FLIP_READ_BYTES='{}': expected a positive integer", every);
  spdlog::warn("test hook REFIT_TEST_FLIP_READ_BYTES={}: corrupting one byte of every {} reads", n, n);
  return flip_read_bytes(std::move(transport), n);
}

}  // namespace refit
