// Whether a bench asks for a GPU that this process cannot use, found before any worker starts so
// that the answer is one line rather than one error per worker.
#pragma once

#include <string>

#include "refit/config.h"
#include "refit/tensor.h"

namespace refit::tools {

struct BenchOptions;

// The option that asks for a GPU ("--device cuda", "refit_cfg.nixl.device=cuda:1",
// "--tensors cuda", "refit_cfg.nixl.backend_name=CUDA_IPC" or NCCL), or "" when none does.
std::string gpu_request(const BenchOptions& options, const RefitConfig& config, MemoryKind tensors);

// The one-line error for `request` when no GPU is usable: `cuda_built` says whether this build
// has CUDA, `reason` is the CUDA runtime's error when it has.
std::string no_gpu_message(const std::string& request, bool cuda_built, const std::string& reason);

// Throws Error(kUnsupported) with no_gpu_message() when `request` is not empty and `device` (a GPU)
// is not usable here, Error(kConfig) when its index is past the GPUs there are.
void check_gpu_request(const std::string& request, const Device& device);

}  // namespace refit::tools
