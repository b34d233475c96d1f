// UCX with GPU transfer buffers: used when this machine's UCX moves CUDA memory; otherwise a
// clear error that names the alternatives.
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "transport/ucx/ucx_transport.h"

namespace refit {
namespace {

using namespace gpu_test;
using namespace std::chrono_literals;

TEST(UcxGpu, GpuBuffersNeedAUcxWithCuda) {
  REFIT_REQUIRE_GPUS(1);
  if (!ucx_capabilities({}).cuda) {
    std::string message;
    EXPECT_EQ(error_kind_of(
                  [&] {
                    create_transport("UCX", {{"device", "cuda:0"}});
                  },
                  &message),
              ErrorKind::kUnsupported);
    EXPECT_NE(message.find("the UCX build here has no CUDA support"), std::string::npos) << message;
    EXPECT_NE(message.find("CUDA_IPC"), std::string::npos) << message;
    EXPECT_NE(message.find("NCCL"), std::string::npos) << message;
    return;
  }
  // This UCX moves CUDA memory: transfer buffers are on the GPU and a read lands bitwise.
  auto source = create_transport("UCX", {{"device", "cuda:0"}});
  auto destination = create_transport("UCX", {{"device", "cuda:0"}});
  const size_t size = (8 << 20) + 3;
  auto remote = source->allocate_memory(size);
  auto local = destination->allocate_memory(size);
  EXPECT_EQ(memory_kind_of(remote.base), MemoryKind::kCuda);
  fill_device(remote.base, size, 8);
  PeerId peer = destination->connect(source->address(), "source rank 0");
  destination->read(peer, source->describe(remote.region), 0, local.base, local.region, size, deadline_after(60s));
  EXPECT_EQ(read_device(local.base, size), pattern(size, 8));
}

}  // namespace
}  // namespace refit
