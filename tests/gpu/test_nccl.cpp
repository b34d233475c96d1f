// The NCCL transport. NCCL puts at most one rank on a GPU, so reads between two processes need
// two GPUs; on one GPU the test checks that sharing it is refused with a clear error.
#include <string>
#include <vector>

#include "gpu_test_util.h"

namespace refit {
namespace {

using namespace gpu_test;
using namespace std::chrono_literals;

#ifdef REFIT_HAVE_NCCL

constexpr size_t kBufferBytes = (32 << 20) + 5;

std::unique_ptr<Transport> nccl_on(int device) {
  return create_transport("NCCL", {{"device", "cuda:" + std::to_string(device)}, {"timeout_s", "120"}});
}

TEST(Nccl, AllocatesDeviceMemoryAndRefusesHostMemory) {
  REFIT_REQUIRE_GPUS(1);
  auto transport = nccl_on(0);
  EXPECT_EQ(transport->name(), "NCCL");
  auto allocation = transport->allocate_memory(1 << 20);
  EXPECT_EQ(memory_kind_of(allocation.base), MemoryKind::kCuda);
  std::vector<uint8_t> host(64);
  std::string message;
  EXPECT_EQ(error_kind_of([&] { transport->register_memory(host.data(), host.size()); }, &message),
            ErrorKind::kUnsupported);
  EXPECT_NE(message.find("GPU memory only"), std::string::npos) << message;
}

TEST(Nccl, TwoRanksOnOneGpuAreRefusedNamingTheAlternative) {
  REFIT_REQUIRE_GPUS(1);
  auto a = nccl_on(0);
  auto b = nccl_on(0);
  std::string message;
  EXPECT_EQ(error_kind_of([&] { a->connect(b->address(), "destination rank 0"); }, &message), ErrorKind::kUnsupported);
  EXPECT_NE(message.find("NCCL cannot put two ranks on one GPU"), std::string::npos) << message;
  EXPECT_NE(message.find("CUDA_IPC"), std::string::npos) << message;
}

// args: device index. Publishes two buffers; serves reads until told "done"; then releases
// buffer b and serves one more read request (which it must refuse).
REFIT_PEER_ROLE(nccl_source) {
  Channel& peer = *channels.at(0);
  auto transport = nccl_on(std::stoi(args.at(0)));
  auto a = transport->allocate_memory(kBufferBytes);
  auto b = transport->allocate_memory(kBufferBytes);
  fill_device(a.base, kBufferBytes, 1);
  fill_device(b.base, kBufferBytes, 2);
  peer.put(transport->address());
  peer.put_region(transport->describe(a.region));
  peer.put_region(transport->describe(b.region));
  PeerId destination = transport->connect(peer.get(), "destination rank 0");
  require(transport->receive(destination, deadline_after(120s)) == Bytes{'d', 'o', 'n', 'e'}, "expected 'done'");
  transport->deregister_memory(b.region);
  transport->send(destination, Bytes{'g', 'o', 'n', 'e'}, deadline_after(30s));
  require(peer.get_text() == "finished", "expected 'finished'");
}

REFIT_PEER_ROLE(nccl_destination) {
  Channel& peer = *channels.at(0);
  auto transport = nccl_on(std::stoi(args.at(0)));
  auto local = transport->allocate_memory(kBufferBytes);
  peer.put(transport->address());
  Bytes address = peer.get();
  RemoteRegion a = peer.get_region(), b = peer.get_region();
  PeerId source = transport->connect(address, "source rank 0");
  auto deadline = [] { return deadline_after(60s); };
  for (int round = 0; round < 3; ++round) {
    transport->read(source, a, 0, local.base, local.region, kBufferBytes, deadline());
    require_equal(read_device(local.base, kBufferBytes), pattern(kBufferBytes, 1), "buffer a");
    transport->read(source, b, 999, local.base + 7, local.region, 1 << 20, deadline());
    std::vector<uint8_t> all = pattern(kBufferBytes, 2);
    require_equal(read_device(local.base + 7, 1 << 20),
                  std::vector<uint8_t>(all.begin() + 999, all.begin() + 999 + (1 << 20)), "part of buffer b");
  }
  transport->send(source, Bytes{'d', 'o', 'n', 'e'}, deadline());
  require(transport->receive(source, deadline()) == Bytes{'g', 'o', 'n', 'e'}, "expected 'gone'");
  // Buffer b is released: the source refuses, and the read fails with its reason, not a hang.
  try {
    transport->read(source, b, 0, local.base, local.region, 4096, deadline());
    throw std::runtime_error("a read of a released region succeeded");
  } catch (const Error& e) {
    const std::string what = e.what();
    require(e.kind() == ErrorKind::kTransport, "expected kTransport, got: " + what);
    require(what.find("refused the read") != std::string::npos, "the error does not say why: " + what);
  }
  peer.put(std::string("finished"));
}

TEST(NcclProcesses, ReadsBetweenTwoGpusBitwise) {
  REFIT_REQUIRE_GPUS(2);
  auto [s, d] = socket_pair();
  Peer source("nccl_source", {s}, {"0"});
  Peer destination("nccl_destination", {d}, {"1"});
  EXPECT_EQ(destination.wait(), 0);
  EXPECT_EQ(source.wait(), 0);
}

#else

TEST(Nccl, IsUnsupportedWithoutNcclInTheBuild) {
  REFIT_REQUIRE_GPUS(1);
  std::string message;
  EXPECT_EQ(error_kind_of([&] { create_transport("NCCL", {}); }, &message), ErrorKind::kUnsupported);
  EXPECT_NE(message.find("NCCL"), std::string::npos) << message;
}

#endif

}  // namespace
}  // namespace refit
