// Which bench option asks for a GPU, and the one line a build without one gives (the CLI tests
// reach only the build they run in: here one with CUDA).
#include "gpu_request.h"

#include <gtest/gtest.h>

#include "bench.h"
#include "refit/config.h"

namespace refit::tools {
namespace {

TEST(GpuRequest, NamesTheOptionThatAsksForAGpu) {
  BenchOptions options;
  RefitConfig config;
  EXPECT_EQ(gpu_request(options, config, MemoryKind::kHost), "");
  EXPECT_EQ(gpu_request(options, config, MemoryKind::kCuda), "--tensors cuda");
  config.backend_name = "nccl";
  EXPECT_EQ(gpu_request(options, config, MemoryKind::kHost), "refit_cfg.nixl.backend_name=nccl");
  config.device = parse_device("cuda:1");
  EXPECT_EQ(gpu_request(options, config, MemoryKind::kCuda), "refit_cfg.nixl.device=cuda:1");
  options.device = "cuda:1";
  EXPECT_EQ(gpu_request(options, config, MemoryKind::kCuda), "--device cuda:1");
}

TEST(GpuRequest, ABuildWithoutCudaSaysHowToBuildOne) {
  EXPECT_EQ(no_gpu_message("--device cuda", false, ""),
            "--device cuda needs a GPU, but this build of refit has no CUDA: rebuild it with -DREFIT_WITH_CUDA=ON on "
            "a host with the CUDA toolkit (nvcc), or use the CPU (--device cpu)");
}

TEST(GpuRequest, ACudaBuildWithoutAGpuGivesTheRuntimesReason) {
  unsetenv("CUDA_VISIBLE_DEVICES");
  EXPECT_EQ(no_gpu_message("--tensors cuda", true, "no CUDA-capable device is detected"),
            "--tensors cuda needs a GPU, but CUDA finds no usable one here: no CUDA-capable device is detected; check "
            "the driver with nvidia-smi, or use the CPU (--device cpu)");
}

}  // namespace
}  // namespace refit::tools
