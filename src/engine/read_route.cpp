#include "engine/read_route.h"

#include <fmt/format.h>

namespace refit {

std::string slow_read_warning(const ReadRoute& route, const std::string& destination, const std::string& source) {
  // CUDA IPC maps or fails loudly, NCCL moves GPU memory with its own kernels, and host memory or
  // another host's GPU memory (GPUDirect RDMA) reads at link speed: only one path falls off.
  const bool reads_gpu_here = route.buffers == MemoryKind::kCuda && route.same_host && !route.mapped;
  if (!reads_gpu_here || (route.transport != "UCX" && route.transport != "NIXL")) return {};
  const std::string fix = route.map_source_buffers
                              ? "backend_name=CUDA_IPC (it maps every source on this host)"
                              : "refit_cfg.nixl.map_source_buffers=true (then it maps them), or backend_name=CUDA_IPC";
  return fmt::format(
      "{} reads the GPU buckets of {} on this host with {} one-sided reads, because {}; such reads measured 0.68 "
      "GiB/s on one H200 (UCX 1.22; NIXL 1.5.1: 0.56 GiB/s), against 621 GiB/s mapped and 1,316 GiB/s in place "
      "over CUDA IPC (docs/GPU.md): set {}",
      destination, source, route.transport,
      route.map_source_buffers ? fmt::format("{} could not map them", route.transport)
                               : std::string("refit_cfg.nixl.map_source_buffers is false"),
      fix);
}

}  // namespace refit
