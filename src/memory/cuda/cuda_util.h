// Private helpers for code that calls the CUDA runtime (memory and transport layers): checked
// calls that turn an error into refit::Error naming the call, a scoped current device, polling a
// stream against a deadline. Only with REFIT_HAVE_CUDA; everything here uses cudart, never the
// driver API (libcuda is loaded by cudart at run time).
#pragma once

#ifdef REFIT_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "core/fail.h"
#include "refit/deadline.h"

namespace refit::cuda {

// "cudaErrorMemoryAllocation: out of memory"
std::string error_text(cudaError_t error);

// Throws Error(kind) "<what>: <call>: <error_text>" when `error` is not cudaSuccess, after clearing
// the runtime's last-error state so that a later cudaGetLastError() does not report it again.
void check(cudaError_t error, std::string_view call, std::string_view what = {},
           ErrorKind kind = ErrorKind::kTransport);

// "80.0 GiB"
std::string gib(uint64_t bytes);

// Makes `device` current for the calling thread for the guard's lifetime (no-op when it already is).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// Waits for everything on `stream` with cudaStreamQuery, sleeping briefly between polls.
// Error(kTimeout) "timed out <what>" past the deadline; Error(kTransport) when the stream failed.
void wait_stream(cudaStream_t stream, Deadline deadline, std::string_view what);

// One poll step of a deadline loop: spins for the first ~50 us of a wait, then sleeps 20 us, so a
// short copy is seen at once and a long one does not burn a core. `spins` counts calls.
void poll_pause(uint64_t& spins);

}  // namespace refit::cuda

#endif  // REFIT_HAVE_CUDA
