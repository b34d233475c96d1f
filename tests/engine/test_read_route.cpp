// The read route measured to be ~200-1,000x slower than the alternatives (UCX reading GPU memory on
// one host without cuda_ipc's reads), and the routes measured under half of the best of their
// memory kind (staged by choice on one host; buckets by choice where CUDA IPC could load tensors in
// place; GPU buffers through UCX or NIXL on one host), are
// named at init with the measurement and what to set instead; every other route stays quiet.
#include "engine/read_route.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace refit {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::string warning(MemoryKind buffers, const char* transport, bool same_host, bool mapped, bool map_option,
                    bool could_map = false, bool direct_reads = true) {
  return slow_read_warning({buffers, transport, same_host, mapped, map_option, could_map, direct_reads},
                           "destination rank 1", "source rank 0");
}

// Sets UCX_CUDA_IPC_ENABLE_GET_ZCOPY for the scope (unset with nullptr), as a worker's environment.
struct CudaIpcReads {
  explicit CudaIpcReads(const char* value) {
    if (value != nullptr)
      ::setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", value, 1);
    else
      ::unsetenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY");
  }
  ~CudaIpcReads() { ::unsetenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY"); }
};

TEST(ReadRoute, ReadsOfGpuBucketsOnThisHostWithoutCudaIpcReadsNameTheCliffAndTheFix) {
  {
    // refit's UCX transport turns cuda_ipc's reads on; a user who turns them off gets the cliff.
    CudaIpcReads off("n");
    EXPECT_THAT(warning(MemoryKind::kCuda, "UCX", true, false, false),
                AllOf(HasSubstr("destination rank 1 reads the GPU buckets of source rank 0 on this host with UCX"),
                      HasSubstr("because refit_cfg.nixl.map_source_buffers is false"), HasSubstr("0.61-0.68 GiB/s"),
                      HasSubstr("export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y"),
                      HasSubstr("set refit_cfg.nixl.map_source_buffers=true")));
  }
  CudaIpcReads unset(nullptr);
  EXPECT_EQ(warning(MemoryKind::kCuda, "UCX", true, false, false), "");
  // NIXL's own UCX context reads through host memory unless the environment says otherwise; mapping
  // was asked for but it could not map.
  EXPECT_THAT(warning(MemoryKind::kCuda, "NIXL", true, false, true),
              AllOf(HasSubstr("because NIXL could not map them"), HasSubstr("set backend_name=CUDA_IPC")));
  CudaIpcReads on("y");
  EXPECT_EQ(warning(MemoryKind::kCuda, "NIXL", true, false, true), "");
}

TEST(ReadRoute, FastRoutesAreQuiet) {
  EXPECT_EQ(warning(MemoryKind::kCuda, "UCX", true, true, true), "");         // mapped
  EXPECT_EQ(warning(MemoryKind::kCuda, "UCX", false, false, true), "");       // another host: GPUDirect RDMA
  EXPECT_EQ(warning(MemoryKind::kHost, "UCX", true, false, false), "");       // host buffers
  EXPECT_EQ(warning(MemoryKind::kCuda, "CUDA_IPC", true, false, false), "");  // maps or fails loudly
  EXPECT_EQ(warning(MemoryKind::kCuda, "NCCL", true, false, false), "");
}

TEST(ReadRoute, StagingWhereTheTransportCouldMapIsNamedWithTheMeasurement) {
  for (const auto* transport : {"CUDA_IPC", "INPROC"})
    EXPECT_THAT(warning(MemoryKind::kCuda, transport, true, false, false, true),
                AllOf(HasSubstr("destination rank 1 copies every bucket of source rank 0 on this host into its own "
                                "buffer"),
                      HasSubstr("map_source_buffers is false"), HasSubstr("625 against 1,725 GB/s"),
                      HasSubstr("set refit_cfg.nixl.map_source_buffers=true")));
  EXPECT_THAT(warning(MemoryKind::kHost, "UCX", true, false, false, true), HasSubstr("9.7 against 42 GB/s"));
  // Nothing to say where it cannot map, or on another host, or when it maps.
  EXPECT_EQ(warning(MemoryKind::kHost, "UCX", true, false, false, false), "");
  EXPECT_EQ(warning(MemoryKind::kHost, "UCX", false, false, false, true), "");
  EXPECT_EQ(warning(MemoryKind::kHost, "UCX", true, true, true, true), "");
}

TEST(ReadRoute, BucketsWhereCudaIpcCouldLoadTheSourcesTensorsInPlaceAreNamedWithTheMeasurement) {
  EXPECT_THAT(warning(MemoryKind::kCuda, "CUDA_IPC", true, true, true, true, false),
              AllOf(HasSubstr("destination rank 1 loads every tensor of source rank 0 on this host from its mapped "
                              "buckets"),
                    HasSubstr("direct_reads is false"), HasSubstr("874 against 1,725 GB/s"),
                    HasSubstr("520 against 706 GB/s"), HasSubstr("set refit_cfg.nixl.direct_reads=true")));
  // In place (the default), another host, host buffers: nothing to say.
  EXPECT_EQ(warning(MemoryKind::kCuda, "CUDA_IPC", true, true, true, true, true), "");
  EXPECT_EQ(warning(MemoryKind::kCuda, "CUDA_IPC", false, false, true, true, false), "");
  EXPECT_EQ(warning(MemoryKind::kHost, "UCX", true, true, true, true, false), "");
}

TEST(ReadRoute, GpuBuffersThroughUcxWithEverySourceOnThisHostNameCudaIpc) {
  for (const auto* transport : {"UCX", "NIXL"})
    EXPECT_THAT(
        same_host_gpu_warning(MemoryKind::kCuda, transport, true, "destination rank 1"),
        AllOf(HasSubstr("destination rank 1 takes GPU weights from sources on this host only"), HasSubstr(transport),
              HasSubstr("706 GB/s for CUDA_IPC in place on one H100"), HasSubstr("set backend_name=CUDA_IPC")));
  // A source on another host needs UCX; host buffers and CUDA_IPC are what it would suggest.
  EXPECT_EQ(same_host_gpu_warning(MemoryKind::kCuda, "UCX", false, "destination rank 1"), "");
  EXPECT_EQ(same_host_gpu_warning(MemoryKind::kHost, "UCX", true, "destination rank 1"), "");
  EXPECT_EQ(same_host_gpu_warning(MemoryKind::kCuda, "CUDA_IPC", true, "destination rank 1"), "");
}

}  // namespace
}  // namespace refit
