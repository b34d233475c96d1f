#include "transport/local_socket/local_peer.h"

#include "core/fail.h"
#include "core/wire.h"

namespace refit {
namespace {

constexpr uint8_t kAddressVersion = 1;

}  // namespace

Bytes encode_local_peer_address(std::string_view magic, const LocalPeerAddress& address) {
  ByteWriter w;
  w.put_raw(magic);
  w.put<uint8_t>(kAddressVersion);
  w.put_raw(address.endpoint);
  w.put_raw(address.identity.process);
  w.put<uint32_t>(address.identity.pid);
  w.put_string<uint32_t>(address.identity.host);
  w.put<int32_t>(address.device);
  w.put_string<uint32_t>(address.bus_id);
  return w.take();
}

LocalPeerAddress decode_local_peer_address(std::string_view magic, std::string_view backend,
                                           std::span<const uint8_t> blob, const std::string& label) {
  ByteReader r(blob, fmt::format("{} address of {}", backend, label));
  r.expect_magic(magic);
  if (uint8_t version = r.get<uint8_t>("version"); version != kAddressVersion)
    fail(ErrorKind::kProtocol, "{} address of {} has version {}, this build speaks {}", backend, label, version,
         kAddressVersion);
  LocalPeerAddress address;
  r.get_raw(address.endpoint, "endpoint");
  r.get_raw(address.identity.process, "process");
  address.identity.pid = r.get<uint32_t>("pid");
  address.identity.host = r.get_string<uint32_t>("host");
  address.device = r.get<int32_t>("device");
  address.bus_id = r.get_string<uint32_t>("bus id");
  r.expect_end();
  return address;
}

}  // namespace refit
