// The CUDA IPC backend ("CUDA_IPC"): transfer buffers in GPU memory that peers of the same host
// map with cudaIpcOpenMemHandle and read with one device-to-device copy (on one GPU, or across
// GPUs by peer copy). Control messages go over a local Unix socket (transport/local_socket).
//
//   allocate_memory  cudaMalloc on the configured device (zero-filled) + cudaIpcGetMemHandle
//   register_memory  device memory from cudaMalloc (any pointer inside an allocation) is exported;
//                    host memory is accepted as a local read target only
//   describe         RemoteRegion{device address, length, key = IPC handle, offset inside the
//                    allocation, owner process, device, owner endpoint}
//   connect          same host only (boot id + hostname), else Error(kTransport)
//   read             opens the owner's handle once per allocation (process-wide cache, closed at
//                    disconnect; the owner process itself uses its pointer), then cudaMemcpyAsync
//                    on the transport's stream, polled until the deadline
//
// Init params: device ("cuda" or "cuda:N", default "cuda": the current device), connect_timeout_s
// (default 30). Throws Error(kUnsupported) when this build or machine has no CUDA, Error(kConfig)
// for a bad device or an unknown parameter.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "refit/ext/transport.h"

namespace refit {

std::unique_ptr<Transport> create_cuda_ipc_transport(const std::map<std::string, std::string>& init_params);

}  // namespace refit
