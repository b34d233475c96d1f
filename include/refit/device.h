// GPUs: detected at run time, optional at build time. This header is the same whether or not the
// build has CUDA (REFIT_WITH_CUDA); without it every GPU request fails with a clear
// Error(kUnsupported) and the CPU paths still work.
//
//   - detection: cuda_built(), cuda_device_count(), check_device(), resolve_cuda_device();
//   - capacity:  total_device_memory_bytes() (GPU total memory, host RAM for cpu) for bucket
//                sizing, check_buffers_fit() before any transfer;
//   - where a pointer lives: memory_kind_of().
// (The engine's GPU memory and copies, DeviceBuffer, HostPin and CopyStream, are in the
// extension tier: refit/ext/device_memory.h.)
//
// Every CUDA call's return code is checked; a failure becomes Error(kTransport) (or kUnsupported
// when CUDA is not usable at all) naming the call and cudaGetErrorString.
//
// Fork: the CUDA driver does not survive fork(). A process that has made any CUDA call (even
// cuda_device_count()) must not fork children that use CUDA; query GPUs in the worker processes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "refit/config.h"
#include "refit/deadline.h"
#include "refit/tensor.h"

namespace refit {

// True when this build has the CUDA data path (compiled with REFIT_WITH_CUDA).
bool cuda_built();

// The number of GPUs this process can use. 0 when there are none, with the reason in `reason`
// ("this build has no CUDA support; ...", or cudaGetDeviceCount's error string). Never throws
// and never aborts; cheap enough to call at every check (not cached: a fork changes the answer).
int cuda_device_count(std::string* reason = nullptr);

// Throws unless `device` can hold transfer buffers in this process:
//   Error(kUnsupported) "this build has no CUDA support; rebuild with REFIT_WITH_CUDA=ON or use device=cpu"
//   Error(kUnsupported) "device cuda requested but CUDA is not available: <cudaGetErrorString>"
//   Error(kConfig)      "device cuda:3 requested but this machine has 1 GPU (indices 0..0)"
// Device cpu always passes.
void check_device(const Device& device);

// The CUDA device index that `device` means: its index, or the calling thread's current device
// for a plain "cuda". Throws as check_device(), and Error(kInvalidArgument) for cpu.
int resolve_cuda_device(const Device& device);

// Makes cuda:N the calling thread's current GPU (cudaSetDevice), where allocations on plain
// "cuda" go; cpu and plain "cuda" do nothing. Throws as check_device().
void set_current_device(const Device& device);

// Total memory of `device` in bytes (capacity, not what is free, so that the bucket size does not
// change between refits): the GPU's total global memory, or this host's RAM for cpu. Throws as
// check_device(). Does not create a CUDA context.
uint64_t total_device_memory_bytes(const Device& device);

// Throws Error(kConfig) when `count` buffers of `bytes` each do not fit in what is free on
// `device` now ("device cuda:0 has 3.2 GiB free of 80.0 GiB; 2 transfer buffers of 4.0 GiB need
// 8.0 GiB: lower update_weights_bucket_memory_ratio or set bucket_bytes"). For cpu the check is
// against total host memory. Call it before allocating transfer buffers.
void check_buffers_fit(const Device& device, uint64_t bytes, int count = 2);

// Where a pointer lives, asked of the CUDA driver (cudaPointerGetAttributes): kCuda for device
// (and managed) memory, kHost otherwise, and always kHost when CUDA is not usable.
MemoryKind memory_kind_of(const void* pointer);

}  // namespace refit
