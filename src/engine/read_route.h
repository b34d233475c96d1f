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
  bool could_map = false;          // the transport maps a peer's buffers on this host
  bool direct_reads = true;        // refit_cfg.nixl.direct_reads
};

// Empty when the route is not a known cliff; otherwise why it is slow, what was measured and what
// to set instead. The cliff: GPU buffers of a source on this host read with UCX (or NIXL over UCX)
// one-sided reads while UCX serves them through host memory (its cuda_ipc reads off). The routes
// measured under half of the best of their memory kind on one GPU (docs/GPU.md, "Every route on
// one GPU"): staged by choice (map_source_buffers=false where the transport could map: a copy per
// byte more) and buckets by choice (direct_reads=false with GPU buffers mapped through CUDA_IPC:
// every byte packed first); same_host_gpu_warning names the third, once per destination.
std::string slow_read_warning(const ReadRoute& route, const std::string& destination, const std::string& source);

// Empty unless GPU buffers go through UCX or NIXL and every link of `destination` is on this
// host (where CUDA_IPC would serve them all).
std::string same_host_gpu_warning(MemoryKind buffers, const std::string& transport, bool every_link_on_this_host,
                                  const std::string& destination);

}  // namespace refit
