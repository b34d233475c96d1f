#include <cuda_runtime.h>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "delta/bits.h"
#include "delta/kernels.h"

namespace refit::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWordsPerThread = static_cast<int>(kDeltaBlockWords / kThreads);  // 8

// Word w of `p` (`bytes` long) as a little-endian integer, zero past the end. Aligned words load
// at once; others (a tensor view that starts mid-word, the tail) byte by byte.
__device__ uint64_t load_word(const unsigned char* p, uint64_t w, uint64_t bytes) {
  const uint64_t at = w * 8;
  if (at + 8 <= bytes && (reinterpret_cast<uintptr_t>(p + at) & 7) == 0)
    return *reinterpret_cast<const uint64_t*>(p + at);
  uint64_t v = 0;
  for (uint64_t k = 0; k < 8 && at + k < bytes; ++k) v |= static_cast<uint64_t>(p[at + k]) << (8 * k);
  return v;
}

// The lanes (elements) of a word that differ, as bits.
__device__ unsigned changed_lanes(uint64_t x, uint32_t element_size) {
  const uint64_t mask = delta_steps::mask_of(element_size);
  const unsigned lanes = 8 / element_size;
  unsigned differ = 0;
  for (unsigned j = 0; j < lanes; ++j)
    differ |= static_cast<unsigned>(((x >> (8 * element_size * j)) & mask) != 0) << j;
  return differ;
}

// Thread t of block b covers words b * kDeltaBlockWords + k * kThreads + t (k < kWordsPerThread):
// a warp's loads are contiguous, and (k, t) order is word order.
__device__ uint64_t word_of(int k) {
  return uint64_t{blockIdx.x} * kDeltaBlockWords + static_cast<uint64_t>(k) * kThreads + threadIdx.x;
}

__global__ void __launch_bounds__(kThreads)
    delta_count(const unsigned char* base, const unsigned char* now, uint64_t bytes, uint32_t element_size,
                uint32_t* counts, uint64_t* sums) {
  const uint64_t words = (bytes + 7) / 8;
  uint32_t changed = 0;
  uint64_t sum = 0;
  for (int k = 0; k < kWordsPerThread; ++k) {
    const uint64_t w = word_of(k);
    if (w >= words) break;
    const uint64_t b = load_word(now, w, bytes);
    sum += word_hash::term(b, w);
    if (base != nullptr) changed += __popc(changed_lanes(load_word(base, w, bytes) ^ b, element_size));
  }
  using Count = cub::BlockReduce<uint32_t, kThreads>;
  using Sum = cub::BlockReduce<unsigned long long, kThreads>;
  __shared__ typename Count::TempStorage count_storage;
  __shared__ typename Sum::TempStorage sum_storage;
  const uint32_t block_changed = Count(count_storage).Sum(changed);
  const unsigned long long block_sum = Sum(sum_storage).Sum(static_cast<unsigned long long>(sum));
  if (threadIdx.x == 0) {
    counts[blockIdx.x] = block_changed;
    sums[blockIdx.x] = block_sum;
  }
}

__global__ void __launch_bounds__(kThreads)
    delta_collect(unsigned char* base, const unsigned char* now, uint64_t bytes, uint32_t element_size,
                  const uint32_t* counts, const uint64_t* offsets, uint64_t* index, uint64_t* before, uint64_t* after) {
  if (counts[blockIdx.x] == 0) return;  // the block's words match: nothing to write
  const uint64_t words = (bytes + 7) / 8;
  const uint64_t mask = delta_steps::mask_of(element_size);
  const unsigned lanes = 8 / element_size;
  using Scan = cub::BlockScan<uint32_t, kThreads>;
  __shared__ typename Scan::TempStorage storage;
  uint64_t next = offsets[blockIdx.x];
  for (int k = 0; k < kWordsPerThread; ++k) {
    const uint64_t w = word_of(k);
    uint64_t a = 0, b = 0;
    unsigned differ = 0;
    if (w < words) {
      a = load_word(base, w, bytes);
      b = load_word(now, w, bytes);
      differ = changed_lanes(a ^ b, element_size);
    }
    uint32_t at = 0, total = 0;
    Scan(storage).ExclusiveSum(static_cast<uint32_t>(__popc(differ)), at, total);
    __syncthreads();  // the scan's storage is used again next turn
    uint64_t o = next + at;
    for (; differ != 0; differ &= differ - 1) {
      const unsigned j = __ffs(differ) - 1;
      const unsigned shift = 8 * element_size * j;
      index[o] = w * lanes + j;
      before[o] = (a >> shift) & mask;
      after[o] = (b >> shift) & mask;
      ++o;
    }
    if (a != b) *reinterpret_cast<uint64_t*>(base + w * 8) = b;  // base holds whole words
    next += total;
  }
}

template <typename T>
__global__ void delta_patch(T* target, const uint64_t* index, const uint64_t* values, uint64_t count, bool steps) {
  for (uint64_t k = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; k < count; k += uint64_t{gridDim.x} * blockDim.x) {
    T* element = target + index[k];
    const uint64_t v = values[k];
    *element = static_cast<T>(steps ? delta_steps::unzigzag(*element, v, sizeof(T)) : v);
  }
}

unsigned grid_of(uint64_t blocks) { return static_cast<unsigned>(blocks); }

}  // namespace

int launch_delta_count(const void* base, const void* now, uint64_t bytes, uint32_t element_size, uint32_t* counts,
                       uint64_t* sums, void* stream) {
  const uint64_t blocks = delta_blocks(bytes);
  if (blocks == 0) return cudaSuccess;
  delta_count<<<grid_of(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const unsigned char*>(base), static_cast<const unsigned char*>(now), bytes, element_size, counts,
      sums);
  return cudaGetLastError();
}

int launch_delta_collect(void* base, const void* now, uint64_t bytes, uint32_t element_size, const uint32_t* counts,
                         const uint64_t* offsets, uint64_t* index, uint64_t* before, uint64_t* after, void* stream) {
  const uint64_t blocks = delta_blocks(bytes);
  if (blocks == 0) return cudaSuccess;
  delta_collect<<<grid_of(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<unsigned char*>(base), static_cast<const unsigned char*>(now), bytes, element_size, counts, offsets,
      index, before, after);
  return cudaGetLastError();
}

int launch_delta_patch(void* target, uint32_t element_size, const uint64_t* index, const uint64_t* values,
                       uint64_t count, bool steps, void* stream) {
  if (count == 0) return cudaSuccess;
  const uint64_t wanted = (count + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(wanted < 65535 ? wanted : 65535);
  auto s = static_cast<cudaStream_t>(stream);
  switch (element_size) {
    case 1:
      delta_patch<<<blocks, kThreads, 0, s>>>(static_cast<uint8_t*>(target), index, values, count, steps);
      break;
    case 2:
      delta_patch<<<blocks, kThreads, 0, s>>>(static_cast<uint16_t*>(target), index, values, count, steps);
      break;
    case 4:
      delta_patch<<<blocks, kThreads, 0, s>>>(static_cast<uint32_t*>(target), index, values, count, steps);
      break;
    default:
      delta_patch<<<blocks, kThreads, 0, s>>>(static_cast<uint64_t*>(target), index, values, count, steps);
  }
  return cudaGetLastError();
}

}  // namespace refit::cuda
