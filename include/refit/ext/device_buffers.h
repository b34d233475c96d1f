// Extension tier (refit/ext/: for backends, benches and bindings built on refit, not for its
// users' programs). Transfer buffers in GPU memory for a backend whose own allocate_memory gives host memory
// (UCX built with CUDA): allocate_memory becomes a DeviceBuffer on `device` registered with the
// inner transport (which must accept GPU memory in register_memory); deregister_memory frees it.
// Everything else goes to the inner transport unchanged.
#pragma once

#include <memory>

#include "refit/config.h"
#include "refit/ext/device_memory.h"
#include "refit/ext/transport.h"

namespace refit {

std::unique_ptr<Transport> with_device_buffers(std::unique_ptr<Transport> inner, const Device& device);

}  // namespace refit
