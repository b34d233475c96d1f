#include "transport/ucx/ucx_address.h"

#include "core/fail.h"
#include "core/wire.h"
#include "core/wire_fields.h"

namespace refit {
namespace {

// Layout: magic, instance id, process, error handling (u8), worker address length (u32), worker address.
constexpr std::string_view kMagic = "RFU3";

}  // namespace

Bytes encode_ucx_address(const InstanceId& id, const ProcessIdentity& process, bool peer_errors,
                         std::span<const uint8_t> worker_address) {
  ByteWriter w;
  w.put_raw(kMagic);
  w.put_raw(id);
  wire::Put put{w};
  process_identity_fields(put, process);
  put(peer_errors, "error handling");
  w.put_bytes<uint32_t>(worker_address);
  return w.take();
}

UcxAddress decode_ucx_address(std::span<const uint8_t> blob, const std::string& label) {
  ByteReader r(blob, "UCX address for " + label);
  r.expect_magic(kMagic);
  UcxAddress address;
  r.get_raw(address.id, "instance id");
  wire::Get get{r};
  process_identity_fields(get, address.process);
  get(address.peer_errors, "error handling");
  const auto worker_address = r.get_bytes<uint32_t>("worker address");
  if (worker_address.empty()) fail(ErrorKind::kProtocol, "malformed {}: the worker address is empty", r.what());
  r.expect_end();
  address.worker_address.assign(worker_address.begin(), worker_address.end());
  return address;
}

InstanceId decode_ucx_message_header(std::span<const uint8_t> header) {
  ByteReader r(header, "UCX message header");
  InstanceId sender;
  r.get_raw(sender, "sender instance id");
  r.expect_end();
  return sender;
}

}  // namespace refit
