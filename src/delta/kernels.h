// The GPU kernels of delta refit (delta/codec.h; delta/device_delta.h drives them):
// the diff of a tensor against its base with the word hash of the new bytes, the compaction of
// the changed elements in index order, and the patch of a held tensor. Plain C++17 on both sides,
// so that the .cu file builds with nvcc's C++17 and the rest with C++20. Each returns the launch's
// cudaError_t as an int; `stream` is a cudaStream_t of the current device.
#pragma once

#include <cstddef>
#include <cstdint>

namespace refit::cuda {

// Words (8 bytes) one block of the diff and hash kernels covers.
constexpr uint64_t kDeltaBlockWords = 2048;

// Blocks of the diff and hash kernels over `bytes` bytes.
inline uint64_t delta_blocks(uint64_t bytes) { return ((bytes + 7) / 8 + kDeltaBlockWords - 1) / kDeltaBlockWords; }

// Per block b: counts[b] = elements of `element_size` bytes that differ between `base` and `now`
// (none when base is null: the kernel then only hashes), sums[b] = the word-hash terms of `now`'s
// words in the block (delta/bits.h). `base` is 8-byte aligned; `now` may be anywhere.
int launch_delta_count(const void* base, const void* now, uint64_t bytes, uint32_t element_size, uint32_t* counts,
                       uint64_t* sums, void* stream);

// Writes block b's changed elements at offsets[b] onward, in index order: their indices and bits
// before and after (little-endian integers), and makes `base` equal to `now` (base holds
// `bytes` rounded up to 8).
int launch_delta_collect(void* base, const void* now, uint64_t bytes, uint32_t element_size, const uint32_t* counts,
                         const uint64_t* offsets, uint64_t* index, uint64_t* before, uint64_t* after, void* stream);

// Element index[k] of `target` becomes values[k] (raw) or the old bits stepped by the zigzagged
// values[k] (steps), for k < count. `target` is aligned to its elements.
int launch_delta_patch(void* target, uint32_t element_size, const uint64_t* index, const uint64_t* values,
                       uint64_t count, bool steps, void* stream);

}  // namespace refit::cuda
