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

// Throws, before any worker starts, the error check_device() gives for `device` (a plain "cuda"
// when `request` asks for a GPU by --tensors or backend_name), prefixed with `request`; nothing
// when `request` is empty or the GPU is usable.
void check_gpu_request(const std::string& request, const Device& device);

}  // namespace refit::tools
