#include "device_kernels.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>

#include "refit/error.h"

namespace refit::tools {
namespace {

constexpr int kThreads = 256;
constexpr uint64_t kMaxBlocks = 4096;
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

void check(cudaError_t status, const char* call) {
  if (status != cudaSuccess)
    throw Error(ErrorKind::kTransport,
                fmt::format("{}: {}: {}", call, cudaGetErrorName(status), cudaGetErrorString(status)));
}

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Word i of the pattern is mix64(seed * golden + i); a partial last word takes its low bytes.
__global__ void fill_kernel(unsigned char* data, uint64_t bytes, uint64_t seed) {
  const uint64_t words = bytes / 8;
  const uint64_t base = seed * kGolden;
  const bool aligned = (reinterpret_cast<uintptr_t>(data) & 7) == 0;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i <= words;
       i += uint64_t(gridDim.x) * blockDim.x) {
    const uint64_t value = mix64(base + i);
    if (i < words && aligned) {
      reinterpret_cast<uint64_t*>(data)[i] = value;
    } else {
      for (uint64_t b = 0; b < 8 && i * 8 + b < bytes; ++b)
        data[i * 8 + b] = static_cast<unsigned char>(value >> (8 * b));
    }
  }
}

// Change k steps element mix64(seed * golden + k) % elements by +1, +2, -1 or -2 (two changes
// drawn at one element race; the hash is taken afterwards, so either result is right).
template <typename T>
__global__ void change_kernel(T* data, uint64_t elements, uint64_t changes, uint64_t seed) {
  for (uint64_t k = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; k < changes;
       k += uint64_t(gridDim.x) * blockDim.x) {
    const uint64_t r = mix64(seed * kGolden + k);
    const uint64_t step = (r >> 62) & 1 ? 1 + ((r >> 61) & 1) : ~uint64_t{0} - ((r >> 61) & 1);
    T& e = data[r % elements];
    e = static_cast<T>(e + step);
  }
}

// Sums mix64(word_i ^ mix64(i + golden)) over the little-endian 8-byte words (the last one
// zero-padded) into *out; the sum does not depend on the order threads add in.
__global__ void hash_kernel(const unsigned char* data, uint64_t bytes, unsigned long long* out) {
  const uint64_t words = (bytes + 7) / 8;
  const bool aligned = (reinterpret_cast<uintptr_t>(data) & 7) == 0;
  uint64_t acc = 0;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < words; i += uint64_t(gridDim.x) * blockDim.x) {
    uint64_t word = 0;
    if (aligned && (i + 1) * 8 <= bytes) {
      word = reinterpret_cast<const uint64_t*>(data)[i];
    } else {
      for (uint64_t b = 0; b < 8 && i * 8 + b < bytes; ++b) word |= uint64_t(data[i * 8 + b]) << (8 * b);
    }
    acc += mix64(word ^ mix64(i + kGolden));
  }
  for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, offset);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, static_cast<unsigned long long>(acc));
}

unsigned blocks_for(uint64_t items) {
  return static_cast<unsigned>(std::clamp<uint64_t>((items + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

}  // namespace

void fill_device_pattern(std::byte* data, uint64_t bytes, uint64_t seed, void* stream) {
  if (bytes == 0) return;
  fill_kernel<<<blocks_for(bytes / 8 + 1), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<unsigned char*>(data), bytes, seed);
  check(cudaGetLastError(), "launching the pattern fill kernel");
}

void change_device_elements(std::byte* data, uint64_t elements, uint32_t element_size, uint64_t changes, uint64_t seed,
                            void* stream) {
  if (elements == 0 || changes == 0) return;
  const unsigned blocks = blocks_for(changes);
  auto s = static_cast<cudaStream_t>(stream);
  switch (element_size) {
    case 1:
      change_kernel<<<blocks, kThreads, 0, s>>>(reinterpret_cast<uint8_t*>(data), elements, changes, seed);
      break;
    case 2:
      change_kernel<<<blocks, kThreads, 0, s>>>(reinterpret_cast<uint16_t*>(data), elements, changes, seed);
      break;
    case 4:
      change_kernel<<<blocks, kThreads, 0, s>>>(reinterpret_cast<uint32_t*>(data), elements, changes, seed);
      break;
    default:
      change_kernel<<<blocks, kThreads, 0, s>>>(reinterpret_cast<uint64_t*>(data), elements, changes, seed);
  }
  check(cudaGetLastError(), "launching the delta workload kernel");
}

std::vector<uint64_t> hash_device_ranges(const std::vector<DeviceRange>& ranges, void* stream_handle) {
  auto stream = static_cast<cudaStream_t>(stream_handle);
  std::vector<uint64_t> sums(ranges.size(), 0);
  if (ranges.empty()) return sums;
  unsigned long long* device_sums = nullptr;
  check(cudaMallocAsync(reinterpret_cast<void**>(&device_sums), sizeof(uint64_t) * ranges.size(), stream),
        "cudaMallocAsync (hash sums)");
  cudaError_t status = cudaMemsetAsync(device_sums, 0, sizeof(uint64_t) * ranges.size(), stream);
  for (size_t i = 0; i < ranges.size() && status == cudaSuccess; ++i) {
    if (ranges[i].bytes == 0) continue;
    hash_kernel<<<blocks_for((ranges[i].bytes + 7) / 8), kThreads, 0, stream>>>(
        reinterpret_cast<const unsigned char*>(ranges[i].data), ranges[i].bytes, device_sums + i);
    status = cudaGetLastError();
  }
  if (status == cudaSuccess)
    status =
        cudaMemcpyAsync(sums.data(), device_sums, sizeof(uint64_t) * ranges.size(), cudaMemcpyDeviceToHost, stream);
  if (status == cudaSuccess) status = cudaStreamSynchronize(stream);
  cudaFreeAsync(device_sums, stream);
  cudaStreamSynchronize(stream);
  check(status, "hashing GPU tensors");
  // The length goes in last, so that trailing zero bytes count.
  for (size_t i = 0; i < ranges.size(); ++i) {
    uint64_t z = sums[i] ^ (ranges[i].bytes * kGolden);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    sums[i] = z ^ (z >> 31);
  }
  return sums;
}

}  // namespace refit::tools
