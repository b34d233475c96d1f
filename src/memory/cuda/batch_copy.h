// One kernel launch that does many device-to-device copies (CopyStream::copy and copy_2d between
// GPU memory): a batch of tensors loaded into a destination's parameters, or the strided
// slices a source packs into a bucket, pay one launch instead of one per copy, and read memory
// another process exported faster than cudaMemcpyAsync does (docs/GPU.md). Plain C++17 on both
// sides, so that the .cu file builds with nvcc's C++17 and the rest with C++20.
#pragma once

#include <cstddef>
#include <cstdint>

namespace refit::cuda {

// `rows` rows of `row_bytes` bytes: row r from src + r * src_pitch to dst + r * dst_pitch. A
// contiguous copy is one row.
struct BatchCopy {
  void* dst = nullptr;  // GPU memory (a device pointer, or a peer's mapped with CUDA IPC)
  const void* src = nullptr;
  uint64_t row_bytes = 0;
  uint64_t rows = 1;
  uint64_t dst_pitch = 0;
  uint64_t src_pitch = 0;
};

// The most copies one launch takes (they travel as the kernel's parameters).
constexpr size_t kMaxBatchCopies = 96;

// Enqueues copies[0, count) (count <= kMaxBatchCopies, destinations disjoint) as one kernel on
// `stream` (a cudaStream_t) of the current device. Returns the launch's cudaError_t as an int.
int launch_batch_copy(const BatchCopy* copies, size_t count, void* stream);

}  // namespace refit::cuda
