// Pinning memory that is pinned already: by another HostPin over the same buffer (the engine's
// in-process destination pins the source's buffers it maps), or by someone else (UCX's CUDA
// memory domain, cudaMallocHost). Each is accepted; only the registrar unregisters, in any order.
#include <sys/mman.h>

#include <cstring>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "refit/ext/device_memory.h"
#include "refit/memory.h"

namespace refit {
namespace {

using namespace gpu_test;

constexpr size_t kBytes = 16 << 20;

// Whether CUDA knows `pointer` as page-locked host memory.
bool page_locked(const void* pointer) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, pointer) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attributes.type == cudaMemoryTypeHost;
}

// Copies `bytes` of host memory to a GPU and back, and checks them bitwise.
void expect_round_trip(std::byte* host, size_t bytes, uint64_t seed) {
  std::vector<uint8_t> expected = pattern(bytes, seed);
  std::memcpy(host, expected.data(), bytes);
  DeviceBuffer device(Device{Device::Kind::kCuda, 0}, bytes);
  cuda_ok(cudaMemcpy(device.data(), host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  std::memset(host, 0, bytes);
  cuda_ok(cudaMemcpy(host, device.data(), bytes, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  EXPECT_EQ(std::memcmp(host, expected.data(), bytes), 0);
}

TEST(HostPinTwice, TheSecondPinAcceptsTheMemoryAndLeavesItToTheFirst) {
  REFIT_REQUIRE_GPUS(1);
  HostBuffer host(kBytes);
  HostPin first = HostPin::pin(host.data(), kBytes);
  ASSERT_TRUE(first.pinned()) << first.reason();
  HostPin second = HostPin::pin(host.data(), kBytes);
  EXPECT_FALSE(second.pinned());
  EXPECT_NE(second.reason().find("page-locked already"), std::string::npos) << second.reason();
  // A part of it, as a destination pins the mapped buffers inside a larger region.
  HostPin inside = HostPin::pin(host.data() + 4096, 1 << 20);
  EXPECT_FALSE(inside.pinned());
  EXPECT_NE(inside.reason().find("page-locked already"), std::string::npos) << inside.reason();
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // the refusal left no error behind
  expect_round_trip(host.data(), kBytes, 1);

  // The pins that did not register let go first: still page-locked.
  second = HostPin();
  inside = HostPin();
  EXPECT_TRUE(page_locked(host.data()));
  // The registrar lets go: unregistered, and pinning works again.
  first = HostPin();
  EXPECT_FALSE(page_locked(host.data()));
  HostPin again = HostPin::pin(host.data(), kBytes);
  EXPECT_TRUE(again.pinned()) << again.reason();
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(HostPinTwice, TheRegistrarMayLetGoFirst) {
  REFIT_REQUIRE_GPUS(1);
  HostBuffer host(kBytes);
  HostPin first = HostPin::pin(host.data(), kBytes);
  ASSERT_TRUE(first.pinned()) << first.reason();
  {
    HostPin second = HostPin::pin(host.data(), kBytes);
    EXPECT_FALSE(second.pinned());
    first = HostPin();
    EXPECT_FALSE(page_locked(host.data()));
    // Pageable now, and copies still work (the driver stages them).
    expect_round_trip(host.data(), kBytes, 2);
  }  // `second` unregisters nothing: no error, and nobody else's registration is undone
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  HostPin third = HostPin::pin(host.data(), kBytes);
  EXPECT_TRUE(third.pinned()) << third.reason();
  HostPin fourth = HostPin::pin(host.data(), kBytes);
  EXPECT_FALSE(fourth.pinned());
  // A moved-from pin releases nothing; the moved-to one keeps the registration.
  HostPin moved = std::move(third);
  EXPECT_TRUE(moved.pinned());
  EXPECT_TRUE(page_locked(host.data()));
}

TEST(HostPinTwice, MemoryRegisteredBySomeoneElseStaysTheirs) {
  REFIT_REQUIRE_GPUS(1);
  HostBuffer host(kBytes);
  // As UCX's CUDA memory domain does when it maps host memory.
  cuda_ok(cudaHostRegister(host.data(), kBytes, cudaHostRegisterPortable), "cudaHostRegister");
  {
    HostPin pin = HostPin::pin(host.data(), kBytes);
    EXPECT_FALSE(pin.pinned());
    EXPECT_NE(pin.reason().find("page-locked already"), std::string::npos) << pin.reason();
    std::string reason;
    EXPECT_FALSE(pin_host_memory(host.data(), kBytes, &reason));
    EXPECT_FALSE(reason.empty());
    expect_round_trip(host.data(), kBytes, 3);
  }
  // The pin is gone and the registration is still there: its owner unregisters it.
  EXPECT_TRUE(page_locked(host.data()));
  EXPECT_EQ(cudaHostUnregister(host.data()), cudaSuccess);
  EXPECT_FALSE(page_locked(host.data()));

  // Memory from cudaMallocHost is page-locked from the start.
  void* allocated = nullptr;
  cuda_ok(cudaMallocHost(&allocated, kBytes), "cudaMallocHost");
  {
    HostPin pin = HostPin::pin(allocated, kBytes);
    EXPECT_FALSE(pin.pinned());
    EXPECT_FALSE(pin.reason().empty());
  }
  EXPECT_TRUE(page_locked(allocated));
  EXPECT_EQ(cudaFreeHost(allocated), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(HostPinTwice, PartlyRegisteredMemoryIsAcceptedAndSaysSo) {
  REFIT_REQUIRE_GPUS(1);
  HostBuffer host(kBytes);
  std::byte* middle = host.data() + (4 << 20);
  cuda_ok(cudaHostRegister(middle, 1 << 20, cudaHostRegisterPortable), "cudaHostRegister");
  {
    HostPin pin = HostPin::pin(host.data(), kBytes);
    EXPECT_FALSE(pin.pinned());
    EXPECT_NE(pin.reason().find("part of"), std::string::npos) << pin.reason();
    expect_round_trip(host.data(), kBytes, 4);
  }
  EXPECT_TRUE(page_locked(middle));
  EXPECT_EQ(cudaHostUnregister(middle), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
}  // namespace refit
