// The address blob a UCX transport publishes: a random instance id followed by the UCP worker
// address. The instance id travels in every control message's header, so that a receiver can
// queue messages per sender even before (or without) connecting back to it.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>

#include "refit/transport.h"

namespace refit {

using InstanceId = std::array<uint8_t, 16>;

InstanceId random_instance_id();

Bytes encode_ucx_address(const InstanceId& id, std::span<const uint8_t> worker_address);

struct UcxAddress {
  InstanceId id{};
  Bytes worker_address;
};

// Throws Error(kProtocol) naming `label` when the blob is not one that encode_ucx_address wrote.
UcxAddress decode_ucx_address(std::span<const uint8_t> blob, const std::string& label);

}  // namespace refit
