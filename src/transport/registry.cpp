#include <algorithm>

#include "core/fail.h"
#include "refit/config.h"
#include "refit/device.h"
#include "refit/ext/device_buffers.h"
#include "refit/ext/transport.h"
#include "transport/cuda_ipc/cuda_ipc_transport.h"
#include "transport/fault_injection.h"
#include "transport/nccl/nccl_transport.h"
#include "transport/ucx/ucx_transport.h"

namespace refit {
namespace {

// UCX takes the transfer-buffer device as init param `device` (the engine passes the config's
// device to every backend); UCX itself does not know the key.
std::unique_ptr<Transport> create_ucx_for_device(std::map<std::string, std::string> params) {
  Device device;
  if (auto it = params.find("device"); it != params.end()) {
    device = parse_device(it->second, "refit_cfg.nixl.backend_init_params.device");
    params.erase(it);
  }
  // Test fault injection (REFIT_TEST_FLIP_READ_BYTES) flips bytes with the CPU: host buffers only.
  if (device.kind == Device::Kind::kCpu) return maybe_inject_faults(create_ucx_transport(params));
  check_device(device);
  if (!ucx_capabilities(params).cuda) {
    fail(ErrorKind::kUnsupported,
         "device {} with backend_name UCX: the UCX build here has no CUDA support (ucx_info -d shows no cuda "
         "transports); use backend_name CUDA_IPC (same host) or NCCL, or device=cpu with UCX",
         to_string(device));
  }
  return with_device_buffers(create_ucx_transport(params, true), device);
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

}  // namespace

std::vector<TransportBackendInfo> transport_backends() {
  std::vector<TransportBackendInfo> out;
  const UcxCapabilities ucx = ucx_capabilities({});
  if (ucx.error.empty())
    out.push_back(
        {"UCX", true,
         fmt::format("UCX {}; transports: {}; memory: {}", ucx.version, join(ucx.transports), join(ucx.memory_types))});
  else
    out.push_back({"UCX", false, fmt::format("UCX {}: {}", ucx.version, ucx.error)});
  std::string no_gpu;
  const int gpus = cuda_device_count(&no_gpu);
  const std::string gpu_reason = cuda_built() ? "no usable GPU: " + no_gpu : "this build has no CUDA (REFIT_WITH_CUDA)";
  if (gpus > 0)
    out.push_back({"CUDA_IPC", true, fmt::format("GPU memory between processes of this host; {} GPU(s)", gpus)});
  else
    out.push_back({"CUDA_IPC", false, gpu_reason});
#if REFIT_HAVE_NCCL
  if (gpus > 0)
    out.push_back({"NCCL", true, fmt::format("NCCL point-to-point; {} GPU(s)", gpus)});
  else
    out.push_back({"NCCL", false, gpu_reason});
#else
  out.push_back({"NCCL", false,
                 cuda_built() ? "this build has no NCCL (REFIT_WITH_NCCL: nccl.h or libnccl not found)"
                              : "this build has no CUDA, which NCCL needs"});
#endif
  return out;
}

std::unique_ptr<Transport> create_transport(const std::string& backend_name,
                                            const std::map<std::string, std::string>& init_params) {
  std::string upper = backend_name;
  std::transform(upper.begin(), upper.end(), upper.begin(), [](unsigned char c) { return std::toupper(c); });
  if (upper == "UCX") return create_ucx_for_device(init_params);
  if (upper == "CUDA_IPC") return create_cuda_ipc_transport(init_params);
  if (upper == "NCCL") return create_nccl_transport(init_params);
  if (upper == "NIXL")
    fail(ErrorKind::kConfig,
         "refit_cfg.nixl.backend_name NIXL is a backend of refit's Python package (refit.nixl, over NIXL's Python "
         "API: pip install nixl-cu12), not of the C++ library, since NIXL publishes no C++ headers to build "
         "against; run the engine from Python, or choose 'UCX', 'CUDA_IPC' or 'NCCL'");
  fail(ErrorKind::kConfig,
       "refit_cfg.nixl.backend_name: unknown transport backend '{}' (expected 'UCX', 'CUDA_IPC' or 'NCCL')",
       backend_name);
}

}  // namespace refit
