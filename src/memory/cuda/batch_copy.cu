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
  uint64_t row_bytes;
  uint64_t rows;
  uint64_t dst_pitch;
  uint64_t src_pitch;
  uint64_t first_chunk;     // chunks of the copies before this one
  uint32_t rows_per_chunk;  // > 0: a chunk is that many whole rows (short rows); 0: kChunk bytes of one row
  uint32_t chunks_per_row;  // when rows_per_chunk is 0
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

// Rows of `row_bytes` bytes (a chunk's worth at most) in words of W bytes, which divide every
// address, pitch and the row: the block's threads stride over the rows' words as one range, so
// rows shorter than the block keep every thread busy.
template <typename W>
__device__ void copy_words(char* dst, uint64_t dst_pitch, const char* src, uint64_t src_pitch, uint64_t row_bytes,
                           uint64_t rows) {
  const uint32_t per_row = static_cast<uint32_t>(row_bytes / sizeof(W));
  const uint32_t words = static_cast<uint32_t>(rows) * per_row;
  for (uint32_t i = threadIdx.x; i < words; i += blockDim.x) {
    const uint32_t r = i / per_row, c = i - r * per_row;
    reinterpret_cast<W*>(dst + r * dst_pitch)[c] = reinterpret_cast<const W*>(src + r * src_pitch)[c];
  }
}

__device__ void copy_rows(char* dst, uint64_t dst_pitch, const char* src, uint64_t src_pitch, uint64_t row_bytes,
                          uint64_t rows) {
  const uint64_t all =
      reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | dst_pitch | src_pitch | row_bytes;
  if ((all & 15) == 0)
    copy_words<uint4>(dst, dst_pitch, src, src_pitch, row_bytes, rows);
  else if ((all & 7) == 0)
    copy_words<uint2>(dst, dst_pitch, src, src_pitch, row_bytes, rows);
  else if ((all & 3) == 0)
    copy_words<uint32_t>(dst, dst_pitch, src, src_pitch, row_bytes, rows);
  else if ((all & 1) == 0)
    copy_words<uint16_t>(dst, dst_pitch, src, src_pitch, row_bytes, rows);
  else
    copy_words<uint8_t>(dst, dst_pitch, src, src_pitch, row_bytes, rows);
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
    const uint64_t local = chunk - j.first_chunk;
    if (j.rows_per_chunk > 0) {
      const uint64_t row = local * j.rows_per_chunk;
      const uint64_t rows = j.rows - row < j.rows_per_chunk ? j.rows - row : j.rows_per_chunk;
      copy_rows(j.dst + row * j.dst_pitch, j.dst_pitch, j.src + row * j.src_pitch, j.src_pitch, j.row_bytes, rows);
    } else {
      const uint64_t row = local / j.chunks_per_row;
      const uint64_t offset = (local - row * j.chunks_per_row) * kChunk;
      const uint64_t n = j.row_bytes - offset < kChunk ? j.row_bytes - offset : kChunk;
      copy_bytes(j.dst + row * j.dst_pitch + offset, j.src + row * j.src_pitch + offset, n);
    }
  }
}

}  // namespace

int launch_batch_copy(const BatchCopy* copies, size_t count, void* stream) {
  Jobs jobs{};
  for (size_t i = 0; i < count && i < kMaxBatchCopies; ++i) {
    const BatchCopy& c = copies[i];
    if (c.row_bytes == 0 || c.rows == 0) continue;
    Job& j = jobs.job[jobs.count++];
    j.dst = static_cast<char*>(c.dst);
    j.src = static_cast<const char*>(c.src);
    j.row_bytes = c.row_bytes;
    j.rows = c.rows;
    j.dst_pitch = c.dst_pitch;
    j.src_pitch = c.src_pitch;
    j.first_chunk = jobs.chunks;
    // Rows up to half a chunk go several to a chunk; longer ones are cut into chunks.
    if (c.rows > 1 && c.row_bytes <= kChunk / 2) {
      j.rows_per_chunk = static_cast<uint32_t>(kChunk / c.row_bytes);
      j.chunks_per_row = 0;
      jobs.chunks += (c.rows + j.rows_per_chunk - 1) / j.rows_per_chunk;
    } else {
      j.rows_per_chunk = 0;
      j.chunks_per_row = static_cast<uint32_t>((c.row_bytes + kChunk - 1) / kChunk);
      jobs.chunks += c.rows * j.chunks_per_row;
    }
  }
  if (jobs.count == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(std::min<uint64_t>(jobs.chunks, kMaxBlocks));
  batch_copy_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(jobs);
  return cudaGetLastError();
}

}  // namespace refit::cuda
