// The arithmetic of delta records (delta/codec.h) that the host and the GPU kernels
// (delta/kernels.cu) share. Plain C++17, also compiled by nvcc.
//
// word_hash: the checksum of a record made from GPU memory (DeltaChecksum::kWords), a sum of one
// mixed term per 8-byte word, so that every block of a kernel hashes its own words and the partial
// sums add up in any order. Each term mixes the word with its position (a moved word changes the
// sum); the mixer is SplitMix64's finalizer. Detects corruption, not an adversary (as xxh3).
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define REFIT_HOST_DEVICE __host__ __device__
#else
#define REFIT_HOST_DEVICE
#endif

namespace refit::word_hash {

REFIT_HOST_DEVICE inline uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// The term of word `index` (its bytes as a little-endian integer; the last word of a tensor whose
// size is not a multiple of 8 is padded with zeros).
REFIT_HOST_DEVICE inline uint64_t term(uint64_t word, uint64_t index) {
  return mix(word ^ ((index + 1) * 0x9e3779b97f4a7c15ULL));
}

// The checksum of `bytes` bytes whose terms sum (modulo 2^64) to `sum`.
REFIT_HOST_DEVICE inline uint64_t finish(uint64_t sum, uint64_t bytes) { return mix(sum ^ mix(bytes)); }

}  // namespace refit::word_hash

namespace refit::delta_steps {

// The mask of an element of `size` bytes as an integer.
REFIT_HOST_DEVICE constexpr uint64_t mask_of(uint64_t size) {
  return size == 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * size)) - 1;
}

// The new element as a difference of bit patterns (modulo 2^bits, so exact whatever the values),
// zigzagged so that small steps either way are small numbers: 0, -1, 1, -2 ... -> 0, 1, 2, 3 ...
// (no branch: steps go either way at random).
REFIT_HOST_DEVICE inline uint64_t zigzag(uint64_t before, uint64_t after, uint64_t size) {
  const unsigned unused = 64 - 8 * static_cast<unsigned>(size);
  const auto d = static_cast<int64_t>((after - before) << unused) >> unused;
  return (static_cast<uint64_t>(d) << 1) ^ static_cast<uint64_t>(d >> 63);
}

REFIT_HOST_DEVICE inline uint64_t unzigzag(uint64_t before, uint64_t z, uint64_t size) {
  const uint64_t magnitude = (z >> 1) + (z & 1);
  return ((z & 1) ? before - magnitude : before + magnitude) & mask_of(size);
}

}  // namespace refit::delta_steps

#undef REFIT_HOST_DEVICE
