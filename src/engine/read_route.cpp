#include "engine/read_route.h"

#include <fmt/format.h>

#include <cstdlib>
#include <optional>
#include <string_view>

namespace refit {
namespace {

// UCX_CUDA_IPC_ENABLE_GET_ZCOPY as UCX reads a yes/no setting: nullopt when unset or "try".
std::optional<bool> cuda_ipc_reads_setting() {
  const char* value = std::getenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY");
  if (value == nullptr) return std::nullopt;
  const std::string_view v(value);
  for (std::string_view yes : {"y", "yes", "on", "1"})
    if (v == yes) return true;
  for (std::string_view no : {"n", "no", "off", "0"})
    if (v == no) return false;
  return std::nullopt;
}

}  // namespace

std::string slow_read_warning(const ReadRoute& route, const std::string& destination, const std::string& source) {
  // CUDA IPC maps or fails loudly, NCCL moves GPU memory with its own kernels, and host memory or
  // another host's GPU memory (GPUDirect RDMA) reads at link speed: only one path falls off.
  const bool reads_gpu_here = route.buffers == MemoryKind::kCuda && route.same_host && !route.mapped;
  if (!reads_gpu_here || (route.transport != "UCX" && route.transport != "NIXL")) return {};
  // UCX serves such reads with cuda_ipc only when told to (without NVLink): refit's UCX transport
  // tells it unless the environment says no; NIXL's own UCX context only when the environment
  // says yes (docs/GPU.md, "No cliff").
  const std::optional<bool> setting = cuda_ipc_reads_setting();
  if (route.transport == "UCX" ? setting.value_or(true) : setting.value_or(false)) return {};
  const std::string fix = route.map_source_buffers
                              ? "backend_name=CUDA_IPC (it maps every source on this host)"
                              : "refit_cfg.nixl.map_source_buffers=true (then it maps them), or backend_name=CUDA_IPC";
  return fmt::format(
      "{} reads the GPU buckets of {} on this host with {} one-sided reads, because {}, and UCX serves them through "
      "host memory unless UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y: such reads measured 0.61-0.68 GiB/s on one GPU (UCX "
      "1.22; NIXL 1.5.1: 0.56 GiB/s), against 129-130 GiB/s with that setting and 621 GiB/s mapped (docs/GPU.md): "
      "export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y, or set {}",
      destination, source, route.transport,
      route.map_source_buffers ? fmt::format("{} could not map them", route.transport)
                               : std::string("refit_cfg.nixl.map_source_buffers is false"),
      fix);
}

}  // namespace refit
