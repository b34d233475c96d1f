#include "transport/ucx/ucx_address.h"

#include <cstring>
#include <random>

#include "core/fail.h"

namespace refit {
namespace {

// Layout: magic, instance id, worker address length (little-endian u32), worker address.
constexpr std::array<uint8_t, 4> kMagic = {'R', 'F', 'U', '1'};
constexpr size_t kHeaderBytes = kMagic.size() + sizeof(InstanceId) + sizeof(uint32_t);

}  // namespace

InstanceId random_instance_id() {
  std::random_device device;
  InstanceId id;
  for (size_t i = 0; i < id.size(); i += sizeof(uint32_t)) {
    uint32_t word = device();
    std::memcpy(id.data() + i, &word, sizeof(word));
  }
  return id;
}

Bytes encode_ucx_address(const InstanceId& id, std::span<const uint8_t> worker_address) {
  Bytes blob;
  blob.reserve(kHeaderBytes + worker_address.size());
  blob.insert(blob.end(), kMagic.begin(), kMagic.end());
  blob.insert(blob.end(), id.begin(), id.end());
  uint32_t length = static_cast<uint32_t>(worker_address.size());
  for (int shift = 0; shift < 32; shift += 8) blob.push_back(static_cast<uint8_t>(length >> shift));
  blob.insert(blob.end(), worker_address.begin(), worker_address.end());
  return blob;
}

UcxAddress decode_ucx_address(std::span<const uint8_t> blob, const std::string& label) {
  if (blob.size() < kHeaderBytes) {
    fail(ErrorKind::kProtocol, "malformed UCX address for {}: {} bytes, expected at least {}", label, blob.size(),
         kHeaderBytes);
  }
  if (!std::equal(kMagic.begin(), kMagic.end(), blob.begin())) {
    fail(ErrorKind::kProtocol, "malformed UCX address for {}: it does not start with the refit UCX magic", label);
  }
  UcxAddress address;
  std::memcpy(address.id.data(), blob.data() + kMagic.size(), address.id.size());
  const uint8_t* length_bytes = blob.data() + kMagic.size() + address.id.size();
  uint32_t length = 0;
  for (int i = 0; i < 4; ++i) length |= static_cast<uint32_t>(length_bytes[i]) << (8 * i);
  if (length == 0 || blob.size() - kHeaderBytes != length) {
    fail(ErrorKind::kProtocol, "malformed UCX address for {}: worker address of {} bytes announced, {} present", label,
         length, blob.size() - kHeaderBytes);
  }
  address.worker_address.assign(blob.begin() + kHeaderBytes, blob.end());
  return address;
}

}  // namespace refit
