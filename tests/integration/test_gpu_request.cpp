// Which bench option asks for a GPU, and the error when none is usable.
#include "gpu_request.h"

#include <gtest/gtest.h>

#include "bench.h"
#include "refit/config.h"
#include "refit/device.h"
#include "refit/error.h"

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

TEST(GpuRequest, AnUnusableGpuIsCheckDevicesErrorAfterTheOptionThatAskedForIt) {
  std::string reason;
  if (cuda_device_count(&reason) > 0) GTEST_SKIP() << "this machine has a GPU (tests/gpu covers it)";
  EXPECT_NO_THROW(check_gpu_request("", Device{}));
  try {
    check_gpu_request("--tensors cuda", Device{});  // a CPU device: the probe checks a plain cuda
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
    const std::string expected = cuda_built() ? "--tensors cuda: device cuda requested but CUDA is not available: "
                                              : "--tensors cuda: device cuda requested but this build has no CUDA";
    EXPECT_TRUE(std::string(e.what()).starts_with(expected)) << e.what();
  }
}

}  // namespace
}  // namespace refit::tools
