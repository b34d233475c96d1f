#include <cuda_runtime.h>

#include <algorithm>

#include "memory/cuda/batch_copy.h"

namespace refit::cuda {
namespace {

// Each block copies chunks of this many bytes, 16 at a time per thread where both sides allow.
constexpr uint64_t kChunk = 64 * 1024;
constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;

struct Job {
  char* dst;
  const char* src;
  uint64_t bytes;
  uint64_t first_chunk;  // chunks of the copies before this one
};

struct Jobs {
  uint32_t count;
  uint64_t chunks;  // of every copy
  Job job[kMaxBatchCopies];
};

constexpr int kUnroll = 4;  // 16-byte loads in flight per thread before their stores

__device__ void copy_bytes(char* dst, const char* src, uint64_t n) {
  const bool vector = ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) == 0;
  uint64_t done = 0;
  if (vector) {
    const uint64_t words = n / 16;
    auto* d = reinterpret_cast<uint4*>(dst);
    const auto* s = reinterpret_cast<const uint4*>(src);
    const uint64_t step = uint64_t{blockDim.x} * kUnroll;
    uint64_t i = threadIdx.x;
    for (; i + (kUnroll - 1) * blockDim.x < words; i += step) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = s[i + u * blockDim.x];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) d[i + u * blockDim.x] = v[u];
    }
    for (; i < words; i += blockDim.x) d[i] = s[i];
    done = words * 16;
  }
  for (uint64_t i = done + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

__global__ void batch_copy_kernel(const __grid_constant__ Jobs jobs) {
  for (uint64_t chunk = blockIdx.x; chunk < jobs.chunks; chunk += gridDim.x) {
    // The copy this chunk belongs to: the last whose first chunk is at most this one.
    uint32_t lo = 0, hi = jobs.count - 1;
    while (lo < hi) {
      const uint32_t mid = (lo + hi + 1) / 2;
      if (jobs.job[mid].first_chunk <= chunk)
        lo = mid;
      else
        hi = mid - 1;
    }
    const Job& j = jobs.job[lo];
    const uint64_t offset = (chunk - j.first_chunk) * kChunk;
    const uint64_t n = j.bytes - offset < kChunk ? j.bytes - offset : kChunk;
    copy_bytes(j.dst + offset, j.src + offset, n);
  }
}

}  // namespace

int launch_batch_copy(const BatchCopy* copies, size_t count, void* stream) {
  Jobs jobs{};
  for (size_t i = 0; i < count && i < kMaxBatchCopies; ++i) {
    if (copies[i].bytes == 0) continue;
    Job& j = jobs.job[jobs.count++];
    j.dst = static_cast<char*>(copies[i].dst);
    j.src = static_cast<const char*>(copies[i].src);
    j.bytes = copies[i].bytes;
    j.first_chunk = jobs.chunks;
    jobs.chunks += (copies[i].bytes + kChunk - 1) / kChunk;
  }
  if (jobs.count == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(std::min<uint64_t>(jobs.chunks, kMaxBlocks));
  batch_copy_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(jobs);
  return cudaGetLastError();
}

}  // namespace refit::cuda
