// ParameterLoader with parameters in GPU memory: a tied weight (two names of one GPU tensor) takes
// the same bytes under both names, compared by their hashes where either side is GPU memory.
#include <gtest/gtest.h>

#include <random>

#include "gpu_test_util.h"
#include "refit/ext/device_memory.h"
#include "refit/parameter_loader.h"

namespace refit::gpu_test {
namespace {

const Device kGpu{Device::Kind::kCuda, 0};

TEST(GpuParameterLoader, ATiedWeightInGpuMemoryTakesOnlyTheSameBytesUnderBothNames) {
  REFIT_REQUIRE_GPUS(1);
  constexpr size_t kBytes = (1 << 20) + 6;  // bf16, not a whole number of words
  const TensorInfo embed{"embed", DType::kBFloat16, {static_cast<int64_t>(kBytes / 2)}};
  const TensorInfo head{"lm_head", DType::kBFloat16, {static_cast<int64_t>(kBytes / 2)}};
  DeviceBuffer parameter(kGpu, kBytes);
  ParameterLoader loader(kGpu);
  loader.add(embed, parameter.data(), MemoryKind::kCuda);
  loader.add(head, parameter.data(), MemoryKind::kCuda);
  // What arrives, on the GPU (CUDA IPC, GPU buffers) or in host memory (pinned buffers).
  DeviceBuffer first(kGpu, kBytes), second(kGpu, kBytes);
  for (uint64_t refit = 0; refit < 3; ++refit) {
    fill_device(first.data(), kBytes, 10 + refit);
    fill_device(second.data(), kBytes, 10 + refit);
    const std::vector<uint8_t> on_host = pattern(kBytes, 10 + refit);
    const TensorView e{&embed, first.data(), MemoryKind::kCuda};
    const TensorView h = refit == 1 ? TensorView{&head, reinterpret_cast<const std::byte*>(on_host.data())}
                                    : TensorView{&head, second.data(), MemoryKind::kCuda};
    loader.load(std::span(&e, 1));
    loader.load(std::span(&h, 1));
    EXPECT_EQ(read_device(parameter.data(), kBytes), on_host) << "refit " << refit;
  }
  // An untied source: different bytes under the two names, in one batch or in two.
  fill_device(first.data(), kBytes, 20);
  fill_device(second.data(), kBytes, 21);
  const TensorView e{&embed, first.data(), MemoryKind::kCuda}, h{&head, second.data(), MemoryKind::kCuda};
  const TensorView both[] = {e, h};
  std::string message;
  EXPECT_EQ(error_kind_of([&] { loader.load(both); }, &message), ErrorKind::kLayout);
  EXPECT_NE(message.find("'embed' and 'lm_head' differ"), std::string::npos) << message;
  loader.load(std::span(&e, 1));
  EXPECT_EQ(error_kind_of([&] { loader.load(std::span(&h, 1)); }, &message), ErrorKind::kLayout);
  EXPECT_EQ(read_device(parameter.data(), kBytes), pattern(kBytes, 20)) << "never the head's bytes";
}

}  // namespace
}  // namespace refit::gpu_test
