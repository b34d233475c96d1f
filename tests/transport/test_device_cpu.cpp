// The GPU layer as seen on a machine without a usable GPU (the CI machine, a CPU-only build, or a
// CUDA build whose runtime finds no driver): clear errors for every GPU request, the CPU copy
// stream, pinning that does nothing, and the transport registry's GPU backends. Tests that need
// "no GPU here" skip on a machine that has one; tests/gpu covers that machine.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "core/error_of.h"
#include "core/host_threads.h"
#include "memory/host_copy_pool.h"
#include "refit/device.h"
#include "refit/error.h"
#include "refit/ext/device_memory.h"
#include "refit/ext/transport.h"
#include "refit/memory.h"

namespace refit {
namespace {

using testing::error_kind_of;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

bool gpu_present() { return cuda_device_count() > 0; }

#define SKIP_IF_GPU() \
  if (gpu_present()) GTEST_SKIP() << "this machine has a usable GPU; tests/gpu covers it"

Device cuda(int index = -1) { return {Device::Kind::kCuda, index}; }

TEST(DeviceDetection, ReportsWhetherTheBuildHasCuda) {
#ifdef REFIT_HAVE_CUDA
  EXPECT_TRUE(cuda_built());
#else
  EXPECT_FALSE(cuda_built());
#endif
}

TEST(DeviceDetection, CountsNoGpuWithAReasonAndNeverThrows) {
  SKIP_IF_GPU();
  std::string reason;
  EXPECT_EQ(cuda_device_count(&reason), 0);
  EXPECT_FALSE(reason.empty());
  if (!cuda_built()) EXPECT_TRUE(contains(reason, "REFIT_WITH_CUDA=ON")) << reason;
  EXPECT_EQ(cuda_device_count(), 0);  // and again: nothing sticky
}

TEST(DeviceDetection, CpuAlwaysPasses) {
  EXPECT_NO_THROW(check_device(Device{}));
  EXPECT_EQ(total_device_memory_bytes(Device{}), total_host_memory_bytes());
  EXPECT_EQ(memory_kind_of(nullptr), MemoryKind::kHost);
  std::vector<int> host(4);
  EXPECT_EQ(memory_kind_of(host.data()), MemoryKind::kHost);
  std::string message;
  EXPECT_EQ(error_kind_of([&] { resolve_cuda_device(Device{}); }, &message), ErrorKind::kInvalidArgument);
}

TEST(DeviceDetection, CudaWithoutAGpuIsAClearError) {
  SKIP_IF_GPU();
  for (Device device : {cuda(), cuda(0), cuda(3)}) {
    std::string message;
    EXPECT_EQ(error_kind_of([&] { check_device(device); }, &message), ErrorKind::kUnsupported) << to_string(device);
    EXPECT_TRUE(contains(message, "device " + to_string(device) + " requested but")) << message;
    if (cuda_built()) {
      // The runtime's own words follow ("CUDA driver version is insufficient ...", "no CUDA-capable device ...").
      EXPECT_TRUE(contains(message, "CUDA is not available: ")) << message;
    } else {
      EXPECT_TRUE(
          contains(message, "this build has no CUDA support; rebuild with REFIT_WITH_CUDA=ON or use device=cpu"))
          << message;
    }
    EXPECT_EQ(error_kind_of([&] { total_device_memory_bytes(device); }), ErrorKind::kUnsupported);
    EXPECT_EQ(error_kind_of([&] { resolve_cuda_device(device); }), ErrorKind::kUnsupported);
    EXPECT_EQ(error_kind_of([&] { check_buffers_fit(device, 1 << 20); }), ErrorKind::kUnsupported);
    EXPECT_EQ(error_kind_of([&] { DeviceBuffer buffer(device, 1 << 20); }), ErrorKind::kUnsupported);
  }
}

TEST(DeviceDetection, BuffersThatCannotFitAreRefusedBeforeAnyTransfer) {
  std::string message;
  const uint64_t total = total_host_memory_bytes();
  EXPECT_EQ(error_kind_of([&] { check_buffers_fit(Device{}, total, 2); }, &message), ErrorKind::kConfig);
  EXPECT_TRUE(contains(message, "2 transfer buffers")) << message;
  EXPECT_TRUE(contains(message, "lower update_weights_bucket_memory_ratio or set bucket_bytes")) << message;
  EXPECT_EQ(error_kind_of([&] { check_buffers_fit(Device{}, std::numeric_limits<uint64_t>::max(), 2); }),
            ErrorKind::kConfig);
  EXPECT_NO_THROW(check_buffers_fit(Device{}, 1 << 20, 2));
}

TEST(DeviceMemory, ADeviceBufferNeedsACudaDevice) {
  EXPECT_EQ(error_kind_of([&] { DeviceBuffer buffer(Device{}, 16); }), ErrorKind::kInvalidArgument);
  DeviceBuffer empty;
  EXPECT_EQ(empty.data(), nullptr);
  EXPECT_EQ(empty.size(), 0u);
  DeviceBuffer moved = std::move(empty);
  EXPECT_EQ(moved.size(), 0u);
}

TEST(DeviceMemory, PinningWithoutAGpuDoesNothingAndSaysWhy) {
  SKIP_IF_GPU();
  HostBuffer buffer(1 << 20);
  std::string reason;
  EXPECT_FALSE(pin_host_memory(buffer.data(), buffer.size(), &reason));
  EXPECT_FALSE(reason.empty());
  HostPin pin = HostPin::pin(buffer.data(), buffer.size());
  EXPECT_FALSE(pin.pinned());
  EXPECT_FALSE(pin.reason().empty());
  HostPin moved = std::move(pin);
  EXPECT_FALSE(moved.pinned());
}

TEST(CopyStream, CopiesHostMemoryAtOnceInIssueOrder) {
  CopyStream stream;
  std::vector<uint8_t> a(1 << 16), b(1 << 16), c(1 << 16);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<uint8_t>(i * 7);
  stream.copy(b.data(), a.data(), a.size(), MemoryKind::kHost, MemoryKind::kHost);
  stream.copy(c.data(), b.data(), b.size(), MemoryKind::kHost, MemoryKind::kHost);  // reads what the first wrote
  stream.copy(c.data(), a.data(), 0, MemoryKind::kHost, MemoryKind::kHost);         // nothing
  EXPECT_FALSE(stream.pending());
  stream.synchronize(deadline_after(std::chrono::seconds(1)));
  EXPECT_EQ(c, a);
  EXPECT_EQ(stream.cuda_stream(), nullptr);
  EXPECT_EQ(error_kind_of([&] { stream.copy(nullptr, a.data(), 4, MemoryKind::kHost, MemoryKind::kHost); }),
            ErrorKind::kInvalidArgument);
}

TEST(CopyStream, CopiesStridedRows) {
  // narrow(dim=1, start=1, len=2) of a [3, 4, 5] uint8 tensor: 3 rows of 2 * 5 bytes, pitch 4 * 5.
  std::vector<uint8_t> tensor(3 * 4 * 5);
  for (size_t i = 0; i < tensor.size(); ++i) tensor[i] = static_cast<uint8_t>(i);
  std::vector<uint8_t> slice(3 * 2 * 5, 0xee);
  CopyStream stream;
  stream.copy_2d(slice.data(), 10, tensor.data() + 5, 20, 10, 3, MemoryKind::kHost, MemoryKind::kHost);
  std::vector<uint8_t> expected;
  for (int a = 0; a < 3; ++a)
    for (int b = 1; b < 3; ++b)
      for (int c = 0; c < 5; ++c) expected.push_back(static_cast<uint8_t>(a * 20 + b * 5 + c));
  EXPECT_EQ(slice, expected);
  EXPECT_EQ(error_kind_of([&] {
              stream.copy_2d(slice.data(), 5, tensor.data(), 20, 10, 3, MemoryKind::kHost, MemoryKind::kHost);
            }),
            ErrorKind::kInvalidArgument);
  stream.copy_2d(slice.data(), 10, tensor.data(), 20, 10, 0, MemoryKind::kHost, MemoryKind::kHost);  // nothing
}

// Large copies split over the pool's threads arrive whole, byte for byte, whatever their size
// against the parts; the pool is used again and again, and small copies stay on the caller.
TEST(HostCopyPool, SplitsLargeCopiesOverItsThreadsAndCopiesEveryByte) {
  HostCopyPool pool(3);
  EXPECT_EQ(pool.threads(), 3);
  const size_t large = HostCopyPool::kMinParallelBytes;
  for (size_t bytes : {size_t{1000}, large, large + 1, 3 * large + 4097}) {
    std::vector<std::byte> src(bytes), dst(bytes + 1, std::byte{0x77});
    for (size_t i = 0; i < bytes; ++i) src[i] = static_cast<std::byte>((i * 2654435761u) >> 24);
    pool.copy(dst.data(), src.data(), bytes);
    EXPECT_EQ(std::memcmp(dst.data(), src.data(), bytes), 0) << bytes << " bytes";
    EXPECT_EQ(dst[bytes], std::byte{0x77}) << "wrote past " << bytes << " bytes";
  }
  HostCopyPool none(0);  // no threads: a plain copy
  std::vector<std::byte> a(large + 5, std::byte{1}), b(large + 5);
  none.copy(b.data(), a.data(), a.size());
  EXPECT_EQ(a, b);
}

// Work in parts runs every part once, on the threads and the caller's, and reports the failure of
// the lowest part that failed (so the error does not depend on timing).
TEST(HostCopyPool, RunsEveryPartOnceAndReportsTheLowestFailure) {
  for (int threads : {0, 3}) {
    HostCopyPool pool(threads);
    std::vector<std::atomic<int>> runs(1000);
    pool.for_each(runs.size(), [&](size_t k) { ++runs[k]; });
    EXPECT_TRUE(std::all_of(runs.begin(), runs.end(), [](const auto& n) { return n == 1; })) << threads;
    const std::string what = testing::error_of(ErrorKind::kInternal, [&] {
      pool.for_each(100, [&](size_t k) {
        if (k % 10 == 7) throw Error(ErrorKind::kInternal, "part " + std::to_string(k) + " failed");
      });
    });
    EXPECT_EQ(what, "part 7 failed") << threads;
  }
}

// The thread count can be set, and a bad setting is refused naming the variable.
TEST(HostCopyPool, TakesItsThreadCountFromTheEnvironmentAndRefusesABadOne) {
  unsetenv("REFIT_HOST_COPY_THREADS");  // unset: the engine's rule for this host's cores, which the planner models
  EXPECT_EQ(HostCopyPool().threads(), host_pool_threads(static_cast<int>(std::thread::hardware_concurrency())));
  setenv("REFIT_HOST_COPY_THREADS", "2", 1);
  EXPECT_EQ(HostCopyPool().threads(), 2);
  for (const char* bad : {"two", "-1", "65", "3x", ""}) {
    setenv("REFIT_HOST_COPY_THREADS", bad, 1);
    const std::string what = testing::error_of(ErrorKind::kConfig, [] { HostCopyPool pool; });
    EXPECT_NE(what.find("REFIT_HOST_COPY_THREADS"), std::string::npos) << bad << ": " << what;
  }
  unsetenv("REFIT_HOST_COPY_THREADS");
}

// A copy stream copies a large contiguous 2-D block (pitches equal to the rows) as one range.
TEST(CopyStream, CopiesALargeContiguousBlockWhole) {
  CopyStream stream;
  const size_t rows = 64, row = (HostCopyPool::kMinParallelBytes / rows) + 64;
  std::vector<std::byte> src(rows * row), dst(rows * row);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>(i * 31);
  stream.copy_2d(dst.data(), row, src.data(), row, row, rows, MemoryKind::kHost, MemoryKind::kHost);
  EXPECT_FALSE(stream.pending());
  EXPECT_EQ(src, dst);
}

TEST(CopyStream, GpuCopiesWithoutAGpuAreAClearError) {
  SKIP_IF_GPU();
  CopyStream stream(cuda(0));
  std::vector<uint8_t> a(64), b(64);
  for (auto [dst, src] :
       {std::pair{MemoryKind::kCuda, MemoryKind::kHost}, std::pair{MemoryKind::kHost, MemoryKind::kCuda},
        std::pair{MemoryKind::kCuda, MemoryKind::kCuda}}) {
    std::string message;
    EXPECT_EQ(error_kind_of([&] { stream.copy(b.data(), a.data(), a.size(), dst, src); }, &message),
              ErrorKind::kUnsupported);
    EXPECT_TRUE(contains(message, "copying GPU memory needs CUDA")) << message;
    EXPECT_EQ(error_kind_of([&] { stream.copy_2d(b.data(), 8, a.data(), 16, 8, 4, dst, src); }),
              ErrorKind::kUnsupported);
  }
  EXPECT_FALSE(stream.pending());
  // Host copies still work on the same stream.
  a[5] = 9;
  stream.copy(b.data(), a.data(), a.size(), MemoryKind::kHost, MemoryKind::kHost);
  EXPECT_EQ(b, a);
}

// ---- the transport registry's GPU backends ----

TEST(TransportRegistry, NamesEveryBackendForAnUnknownOne) {
  std::string message;
  EXPECT_EQ(error_kind_of([&] { create_transport("RDMA", {}); }, &message), ErrorKind::kConfig);
  EXPECT_TRUE(contains(message, "'RDMA'")) << message;
  EXPECT_TRUE(contains(message, "'UCX', 'CUDA_IPC' or 'NCCL'")) << message;
}

TEST(TransportRegistry, NixlSaysItIsThePythonPackagesBackend) {
  std::string message;
  EXPECT_EQ(error_kind_of([&] { create_transport("nixl", {}); }, &message), ErrorKind::kConfig);
  EXPECT_TRUE(contains(message, "backend_name NIXL is a backend of refit's Python package")) << message;
  EXPECT_TRUE(contains(message, "pip install nixl-cu12")) << message;
}

TEST(TransportRegistry, GpuBackendsWithoutAGpuAreUnsupportedNamingWhy) {
  SKIP_IF_GPU();
  for (const char* backend : {"CUDA_IPC", "cuda_ipc", "NCCL"}) {
    for (const char* device : {"cuda", "cuda:0", "cuda:5"}) {
      std::string message;
      EXPECT_EQ(error_kind_of(
                    [&] {
                      create_transport(backend, {{"device", device}});
                    },
                    &message),
                ErrorKind::kUnsupported)
          << backend << " " << device;
      if (!cuda_built()) {
        EXPECT_TRUE(contains(message, "this build has no CUDA support")) << message;
      } else {
#ifdef REFIT_HAVE_NCCL
        const bool nccl_built = true;
#else
        const bool nccl_built = false;
#endif
        if (std::string(backend) == "NCCL" && !nccl_built) {
          EXPECT_TRUE(contains(message, "this build has none")) << message;
        } else {
          EXPECT_TRUE(contains(message, "requested but CUDA is not available: ")) << message;
        }
      }
    }
  }
}

TEST(TransportRegistry, GpuBackendsCheckTheirParams) {
  if (!cuda_built()) GTEST_SKIP() << "without CUDA the backends refuse before reading their params";
  std::string message;
  EXPECT_EQ(error_kind_of([&] { create_transport("CUDA_IPC", {{"device", "cpu"}}); }, &message), ErrorKind::kConfig);
  EXPECT_TRUE(contains(message, "backend_name CUDA_IPC moves GPU memory")) << message;
  EXPECT_EQ(error_kind_of([&] { create_transport("CUDA_IPC", {{"bogus", "1"}}); }, &message), ErrorKind::kConfig);
  EXPECT_TRUE(contains(message, "backend_init_params.bogus")) << message;
  EXPECT_EQ(error_kind_of([&] { create_transport("CUDA_IPC", {{"connect_timeout_s", "soon"}}); }), ErrorKind::kConfig);
  // Every wait has a deadline: an infinite one is refused.
  EXPECT_EQ(error_kind_of(
                [&] {
                  create_transport("CUDA_IPC", {{"connect_timeout_s", "inf"}});
                },
                &message),
            ErrorKind::kConfig);
  EXPECT_TRUE(contains(message, "finite")) << message;
#ifdef REFIT_HAVE_NCCL
  EXPECT_EQ(error_kind_of([&] { create_transport("NCCL", {{"device", "cuda:x"}}); }), ErrorKind::kConfig);
  EXPECT_EQ(error_kind_of([&] { create_transport("NCCL", {{"timeout_s", "0"}}); }), ErrorKind::kConfig);
#endif
}

TEST(TransportRegistry, UcxWithGpuBuffersWithoutAGpuIsAClearError) {
  SKIP_IF_GPU();
  std::string message;
  EXPECT_EQ(error_kind_of([&] { create_transport("UCX", {{"device", "cuda:0"}}); }, &message), ErrorKind::kUnsupported);
  EXPECT_TRUE(contains(message, "device cuda:0 requested but")) << message;
  EXPECT_EQ(error_kind_of([&] { create_transport("UCX", {{"device", "tpu"}}); }, &message), ErrorKind::kConfig);
  EXPECT_TRUE(contains(message, "backend_init_params.device")) << message;
}

TEST(TransportRegistry, UcxTakesTheCpuDevice) {
  auto transport = create_transport("UCX", {{"device", "cpu"}});
  EXPECT_EQ(transport->name(), "UCX");
}

}  // namespace
}  // namespace refit
