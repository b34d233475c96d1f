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
  if (route.same_host && route.mapped && !route.direct_reads && route.buffers == MemoryKind::kCuda &&
      route.transport == "CUDA_IPC")
    return fmt::format(
        "{} loads every tensor of {} on this host from its mapped buckets, because refit_cfg.nixl.direct_reads is "
        "false, though CUDA_IPC could load them from the source's own GPU memory: a copy per byte more (the source's "
        "pack), measured at 0.51 of loading in place on one H200 (874 against 1,725 GB/s, qwen3-8b) and 0.74 on one "
        "H100 (520 against 706 GB/s, a 2.2 GiB model; docs/GPU.md): set refit_cfg.nixl.direct_reads=true",
        destination, source);
  if (route.same_host && !route.mapped && !route.map_source_buffers && route.could_map &&
      !(route.buffers == MemoryKind::kCuda && (route.transport == "UCX" || route.transport == "NIXL")))
    return fmt::format(
        "{} copies every bucket of {} on this host into its own buffer before loading it, because "
        "refit_cfg.nixl.map_source_buffers is false, though {} could map them: a copy per byte more, measured at 0.36 "
        "of the fastest route with GPU buffers (625 against 1,725 GB/s on one H200, 382 against 706 on one H100) and "
        "0.23 with pinned host buffers "
        "(9.7 against 42 GB/s; docs/GPU.md): set refit_cfg.nixl.map_source_buffers=true",
        destination, source, route.transport);
  // CUDA IPC maps or fails loudly, NCCL moves GPU memory with its own kernels, and host memory or
  // another host's GPU memory (GPUDirect RDMA) reads at link speed: only one path falls off a cliff.
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

std::string same_host_gpu_warning(MemoryKind buffers, const std::string& transport, bool every_link_on_this_host,
                                  const std::string& destination) {
  if (buffers != MemoryKind::kCuda || !every_link_on_this_host || (transport != "UCX" && transport != "NIXL"))
    return {};
  return fmt::format(
      "{} takes GPU weights from sources on this host only, through {}, which maps their buckets or reads them but "
      "never loads their tensors in place: measured mapped at 512 GB/s and read at 506 GB/s against 706 GB/s for "
      "CUDA_IPC in place on one H100 (0.72; mapped at 0.36 on one H200, docs/GPU.md): set backend_name=CUDA_IPC",
      destination, transport);
}

}  // namespace refit
