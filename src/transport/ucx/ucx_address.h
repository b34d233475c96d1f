// The address blob a UCX transport publishes: magic "RFU3", a random instance id (16 bytes), the
// process it runs in (core/process_identity.h), whether its endpoints handle peer errors (u8: UCX
// connects only endpoints of one error handling mode), the UCP worker address's length (u32,
// little-endian) and the worker address, which refit passes to UCX as it is. The instance id
// travels as the header of every control message (an active message), so that a receiver can
// queue messages per sender even before (or without) connecting back to it. The process lets a
// peer on the same host see that it is gone where UCX does not say so. Encoded with the wire codec (core/wire.h);
// nothing here needs UCX, so that tests and the fuzz target fuzz/fuzz_ucx_address.cpp reach the decoders without it.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>

#include "core/process_identity.h"
#include "core/random_id.h"
#include "refit/ext/transport.h"

namespace refit {

using InstanceId = RandomId;  // random_id()

Bytes encode_ucx_address(const InstanceId& id, const ProcessIdentity& process, bool peer_errors,
                         std::span<const uint8_t> worker_address);

struct UcxAddress {
  InstanceId id{};
  ProcessIdentity process;
  bool peer_errors = true;  // ucx_error_handling_mode: peer (else none)
  Bytes worker_address;
};

// Throws Error(kProtocol) "malformed UCX address for <label>: ..." when the blob is not one that
// encode_ucx_address wrote (an empty worker address included).
UcxAddress decode_ucx_address(std::span<const uint8_t> blob, const std::string& label);

// The sender's instance id from a control message's header (the id's 16 bytes, nothing more).
// Throws Error(kProtocol) "malformed UCX message header: ..." otherwise.
InstanceId decode_ucx_message_header(std::span<const uint8_t> header);

}  // namespace refit
