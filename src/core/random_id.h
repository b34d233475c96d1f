// Random identifiers (sessions, transport instances, endpoints, engine generations), drawn from
// std::random_device, the kernel's entropy: processes started at the same instant never share one.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <random>

namespace refit {

using RandomId = std::array<uint8_t, 16>;

inline RandomId random_id() {
  std::random_device device;
  RandomId id;
  for (size_t i = 0; i < id.size(); i += sizeof(uint32_t)) {
    const uint32_t word = device();
    for (size_t b = 0; b < sizeof(uint32_t); ++b) id[i + b] = static_cast<uint8_t>(word >> (8 * b));
  }
  return id;
}

inline uint64_t random_u64() {
  std::random_device device;
  return (uint64_t{device()} << 32) ^ device();
}

}  // namespace refit
