// `refit bench` with GPU-resident tensors, end to end: real worker processes, the CUDA IPC and
// UCX transports, every tensor hashed on the GPU and compared with its source after every refit.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdio>
#include <string>

#include "gpu_test_util.h"

namespace refit::gpu_test {
namespace {

struct Run {
  int status = -1;
  std::string output;
};

// Runs the refit CLI with `args`; stdout and stderr together.
Run refit_cli(const std::string& args) {
  const std::string command = std::string(REFIT_CLI_PATH) + " " + args + " 2>&1";
  Run run;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return run;
  char chunk[4096];
  size_t n;
  while ((n = fread(chunk, 1, sizeof(chunk), pipe)) > 0) run.output.append(chunk, n);
  const int raw = pclose(pipe);
  run.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  return run;
}

void expect_verified(const Run& run) {
  EXPECT_EQ(run.status, 0) << run.output;
  EXPECT_NE(run.output.find("verified: yes"), std::string::npos) << run.output;
}

TEST(GpuBench, CudaIpcRefitsGpuTensorsBitwise) {
  REFIT_REQUIRE_GPUS(1);
  // By default the destination reads every tensor straight from the source's GPU memory.
  auto run = refit_cli("bench --device cuda --refits 3");
  expect_verified(run);
  EXPECT_NE(run.output.find("100% of the bytes read in place"), std::string::npos) << run.output;
}

TEST(GpuBench, WithoutDirectReadsEveryTensorGoesThroughTheMappedBuckets) {
  REFIT_REQUIRE_GPUS(1);
  auto run = refit_cli("bench --device cuda --refits 2 refit_cfg.nixl.direct_reads=false");
  expect_verified(run);
  EXPECT_EQ(run.output.find("read in place"), std::string::npos) << run.output;
}

TEST(GpuBench, StagedReadsIntoTheDestinationsBuffersToo) {
  REFIT_REQUIRE_GPUS(1);
  expect_verified(refit_cli("bench --device cuda --refits 2 refit_cfg.nixl.map_source_buffers=false"));
}

TEST(GpuBench, TensorsSplitOverBucketsAreMergedOnTheGpu) {
  REFIT_REQUIRE_GPUS(1);
  // 8 MiB buckets split the 62.5 MiB embedding and LM head over many buckets (tensors go through
  // buckets only without direct reads).
  auto run =
      refit_cli("bench --device cuda --refits 2 refit_cfg.nixl.bucket_bytes=8MiB refit_cfg.nixl.direct_reads=false");
  expect_verified(run);
}

TEST(GpuBench, ShardedDestinationsGetTheirGpuSlices) {
  REFIT_REQUIRE_GPUS(1);
  // Row-parallel (dim 1) slices are gathered on the GPU by a 2-D copy.
  expect_verified(
      refit_cli("bench --device cuda --sources 2 --destinations 2 --tp 2 --shard-dense --refits 2 "
                "refit_cfg.nixl.shard_expert_weights=true refit_cfg.nixl.bucket_bytes=16MiB"));
}

TEST(GpuBench, DeltaRefitsOfGpuTensorsSendOnlyTheChanges) {
  REFIT_REQUIRE_GPUS(1);
  // The diff and compaction run on the GPU; each destination checks every tensor after patching.
  for (const char* device : {"--device cuda", "--device cpu --tensors cuda"}) {
    auto run = refit_cli(std::string("bench ") + device +
                         " --refits 4 --changed 0.01 refit_cfg.nixl.delta=true refit_cfg.nixl.bucket_bytes=16MiB");
    expect_verified(run);
    EXPECT_NE(run.output.find("delta refits:"), std::string::npos) << run.output;
  }
}

TEST(GpuBench, PinnedHostBuffersMoveGpuTensors) {
  REFIT_REQUIRE_GPUS(1);
  expect_verified(refit_cli("bench --device cpu --tensors cuda --refits 2 refit_cfg.nixl.bucket_bytes=16MiB"));
  expect_verified(
      refit_cli("bench --device cpu --tensors cuda --refits 2 refit_cfg.nixl.bucket_bytes=16MiB "
                "refit_cfg.nixl.map_source_buffers=false"));
}

TEST(GpuBench, AnOutOfRangeDeviceFailsBeforeAnyTransfer) {
  REFIT_REQUIRE_GPUS(1);
  auto run = refit_cli("bench --device cuda:64 --refits 1");
  EXPECT_NE(run.status, 0) << run.output;
  EXPECT_NE(run.output.find("--device cuda:64: device cuda:64 requested but this machine has"), std::string::npos)
      << run.output;
}

TEST(GpuBench, BuffersLargerThanTheGpuAreRefusedBeforeAllocating) {
  REFIT_REQUIRE_GPUS(1);
  auto run = refit_cli("bench --device cuda --refits 1 refit_cfg.nixl.bucket_bytes=4TiB");
  EXPECT_NE(run.status, 0) << run.output;
  EXPECT_NE(run.output.find("2 transfer buffers of 4096.0 GiB need 8192.0 GiB"), std::string::npos) << run.output;
}

TEST(GpuBench, ChecksumsNeedHostBuffers) {
  REFIT_REQUIRE_GPUS(1);
  auto run = refit_cli("bench --device cuda --refits 1 refit_cfg.nixl.verify_checksums=true");
  EXPECT_NE(run.status, 0) << run.output;
  EXPECT_NE(run.output.find("refit_cfg.nixl.verify_checksums"), std::string::npos) << run.output;
}

}  // namespace
}  // namespace refit::gpu_test
