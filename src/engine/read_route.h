// How a destination reads a source's transfer buffers, and whether that way is one measured to be
// orders of magnitude slower than another the user can pick (docs/GPU.md, "No cliff"): a user who
// turns mapping off, or whose transport cannot map, must not get a 1,000x slower refit silently.
#pragma once

#include <string>

#include "refit/tensor.h"

namespace refit {

struct ReadRoute {
  MemoryKind buffers = MemoryKind::kHost;  // where the source's transfer buffers live
  std::string transport;                   // Transport::name()
  bool same_host = false;
  bool mapped = false;             // the destination maps the source's buffers (loads from them)
  bool map_source_buffers = true;  // refit_cfg.nixl.map_source_buffers
};

// Empty when the route is not a known cliff; otherwise why it is slow, what was measured and what
// to set instead. The cliff: GPU buffers of a source on this host read with UCX (or NIXL over UCX)
// one-sided reads instead of mapped, while UCX serves them through host memory because its
// cuda_ipc reads are off (UCX_CUDA_IPC_ENABLE_GET_ZCOPY: refit's UCX transport turns them on
// unless the environment says no; NIXL's UCX only when it says yes): 0.61-0.68 GiB/s on one GPU,
// against 129-130 GiB/s with cuda_ipc's reads and 621 GiB/s mapped.
std::string slow_read_warning(const ReadRoute& route, const std::string& destination, const std::string& source);

}  // namespace refit
