// GPU kernels of the bench programs: synthetic weights written on the GPU and a 64-bit hash of
// GPU memory, so that a refit of tens of GiB between GPU-resident tensors is checked bitwise
// without moving the model through the host. Built with the CUDA data path
// (tools/device_kernels.cu); without it every function throws Error(kUnsupported).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace refit::tools {

struct DeviceRange {
  const std::byte* data = nullptr;  // GPU memory of the current device
  uint64_t bytes = 0;
};

// Fills `bytes` at `data` (GPU memory) with a pattern determined by `seed`, on `stream`
// (a cudaStream_t; null: the legacy default stream). Asynchronous.
void fill_device_pattern(std::byte* data, uint64_t bytes, uint64_t seed, void* stream);

// The bench's delta workload on the GPU: `changes` elements of `element_size` bytes (1, 2, 4 or
// 8; `data` aligned to it), at positions drawn from `seed`, step by one or two units in the last
// place, up or down (their bits as an integer), as an optimizer step moves a bf16 weight.
// Asynchronous on `stream`.
void change_device_elements(std::byte* data, uint64_t elements, uint32_t element_size, uint64_t changes, uint64_t seed,
                            void* stream);

// A 64-bit hash of each range, position-sensitive at every byte (a changed, moved or missing
// byte changes it). Waits for `stream` first and for the hashes before returning.
std::vector<uint64_t> hash_device_ranges(const std::vector<DeviceRange>& ranges, void* stream);

}  // namespace refit::tools
