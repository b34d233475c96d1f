// The CUDA_IPC transport: in one process (the owner's pointer is used directly), between two
// processes on one GPU and, with two GPUs, across GPUs; bitwise. Peer loss and bad input.
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "refit/ext/device_memory.h"
#include "refit/memory.h"
#include "transport/local_socket/local_peer.h"

namespace refit {
namespace {

using namespace gpu_test;
using namespace std::chrono_literals;
using Params = std::map<std::string, std::string>;

constexpr size_t kBufferBytes = (32 << 20) + 5;
constexpr size_t kInteriorOffset = 4096 + 8;
constexpr size_t kInteriorBytes = (1 << 20) + 3;

std::unique_ptr<Transport> ipc_on(int device) {
  return create_transport("CUDA_IPC", {{"device", "cuda:" + std::to_string(device)}});
}

std::vector<uint8_t> slice(const std::vector<uint8_t>& all, size_t offset, size_t length) {
  return {all.begin() + static_cast<std::ptrdiff_t>(offset),
          all.begin() + static_cast<std::ptrdiff_t>(offset + length)};
}

TEST(CudaIpc, AllocatesZeroedDeviceMemory) {
  REFIT_REQUIRE_GPUS(1);
  auto transport = ipc_on(0);
  EXPECT_EQ(transport->name(), "CUDA_IPC");
  auto allocation = transport->allocate_memory(1 << 20);
  EXPECT_EQ(memory_kind_of(allocation.base), MemoryKind::kCuda);
  std::vector<uint8_t> back = read_device(allocation.base, 1 << 20);
  EXPECT_TRUE(std::all_of(back.begin(), back.end(), [](uint8_t b) { return b == 0; }));
  RemoteRegion region = transport->describe(allocation.region);
  EXPECT_EQ(region.address, reinterpret_cast<uint64_t>(allocation.base));
  EXPECT_EQ(region.length, 1u << 20);
  EXPECT_FALSE(region.key.empty());
  transport->deregister_memory(allocation.region);
  EXPECT_EQ(error_kind_of([&] { transport->describe(allocation.region); }), ErrorKind::kInvalidArgument);
}

// A source keeps its tensors' registrations across refits; it must notice when the memory under
// one was freed and allocated again (even at the same address), whose IPC handle differs.
TEST(CudaIpc, ARegistrationIsNoLongerCurrentOnceItsMemoryIsReplaced) {
  REFIT_REQUIRE_GPUS(1);
  auto transport = ipc_on(0);
  const Device gpu{Device::Kind::kCuda, 0};
  auto memory = std::make_unique<DeviceBuffer>(gpu, 1 << 20);
  std::byte* base = memory->data();
  RegionId tensor = transport->register_memory(base + 4096, 1000);
  EXPECT_TRUE(transport->registration_current(tensor));
  EXPECT_TRUE(transport->registration_current(tensor));
  memory.reset();
  EXPECT_FALSE(transport->registration_current(tensor));  // freed
  memory = std::make_unique<DeviceBuffer>(gpu, 1 << 20);  // often at the same address
  EXPECT_FALSE(transport->registration_current(tensor)) << (memory->data() == base ? "same address" : "elsewhere");
  RegionId again = transport->register_memory(memory->data() + 4096, 1000);
  EXPECT_TRUE(transport->registration_current(again));
  EXPECT_TRUE(transport->capabilities().maps_registered_memory);
}

TEST(CudaIpc, ReadsWithinOneProcess) {
  REFIT_REQUIRE_GPUS(1);
  auto source = ipc_on(0);
  auto destination = ipc_on(0);
  auto remote = source->allocate_memory(kBufferBytes);
  fill_device(remote.base, kBufferBytes, 1);
  auto local = destination->allocate_memory(kBufferBytes);
  PeerId to_source = destination->connect(source->address(), "source rank 0");
  PeerId to_destination = source->connect(destination->address(), "destination rank 0");
  RemoteRegion region = source->describe(remote.region);

  destination->read(to_source, region, 0, local.base, local.region, kBufferBytes, deadline_after(30s));
  EXPECT_EQ(read_device(local.base, kBufferBytes), pattern(kBufferBytes, 1));
  destination->read(to_source, region, 777, local.base + 5, local.region, 4096, deadline_after(30s));
  EXPECT_EQ(read_device(local.base + 5, 4096), slice(pattern(kBufferBytes, 1), 777, 4096));

  source->send(to_destination, Bytes{1, 2, 3}, deadline_after(5s));
  EXPECT_EQ(destination->receive(to_source, deadline_after(5s)), (Bytes{1, 2, 3}));
  destination->send(to_source, Bytes{}, deadline_after(5s));
  EXPECT_EQ(source->receive(to_destination, deadline_after(5s)), Bytes{});

  std::string message;
  EXPECT_EQ(error_kind_of(
                [&] {
                  destination->read(to_source, region, kBufferBytes - 10, local.base, local.region, 11,
                                    deadline_after(5s));
                },
                &message),
            ErrorKind::kInvalidArgument);
  EXPECT_NE(message.find("source rank 0"), std::string::npos) << message;
  EXPECT_EQ(error_kind_of([&] {
              destination->read(to_source, region, 0, local.base + 1, local.region, kBufferBytes, deadline_after(5s));
            }),
            ErrorKind::kInvalidArgument);
  destination->disconnect(to_source);
  source->disconnect(to_destination);
}

TEST(CudaIpc, HostMemoryIsALocalTargetOnly) {
  REFIT_REQUIRE_GPUS(1);
  auto source = ipc_on(0);
  auto destination = ipc_on(0);
  HostBuffer host(1 << 20);
  RegionId host_region = source->register_memory(host.data(), host.size());
  auto remote = source->allocate_memory(1 << 20);
  fill_device(remote.base, 1 << 20, 4);
  HostBuffer target(1 << 20);
  RegionId target_region = destination->register_memory(target.data(), target.size());
  PeerId peer = destination->connect(source->address(), "source rank 0");
  // Device to host memory works...
  destination->read(peer, source->describe(remote.region), 0, target.data(), target_region, 1 << 20,
                    deadline_after(30s));
  std::vector<uint8_t> expected = pattern(1 << 20, 4);
  EXPECT_EQ(std::memcmp(target.data(), expected.data(), 1 << 20), 0);
  // ... but host memory cannot be mapped by a peer.
  std::string message;
  EXPECT_EQ(error_kind_of(
                [&] {
                  destination->read(peer, source->describe(host_region), 0, target.data(), target_region, 16,
                                    deadline_after(5s));
                },
                &message),
            ErrorKind::kUnsupported);
  EXPECT_NE(message.find("host memory"), std::string::npos) << message;
}

TEST(CudaIpc, RefusesPeersOnAnotherHostAndForeignAddresses) {
  REFIT_REQUIRE_GPUS(1);
  auto transport = ipc_on(0);
  LocalPeerAddress elsewhere;
  elsewhere.endpoint = random_id();
  elsewhere.identity = local_identity();
  elsewhere.identity.host = "another-boot-id/another-host";
  elsewhere.device = 0;
  std::string message;
  EXPECT_EQ(error_kind_of([&] { transport->connect(encode_local_peer_address("RFCI", elsewhere), "source rank 4"); },
                          &message),
            ErrorKind::kTransport);
  EXPECT_NE(message.find("CUDA IPC needs both peers on one host"), std::string::npos) << message;
  EXPECT_NE(message.find("source rank 4"), std::string::npos) << message;
  auto ucx = create_transport("UCX", {});
  EXPECT_EQ(error_kind_of([&] { transport->connect(ucx->address(), "source rank 5"); }, &message),
            ErrorKind::kProtocol);
  EXPECT_NE(message.find("source rank 5"), std::string::npos) << message;
  EXPECT_EQ(error_kind_of([&] { create_transport("CUDA_IPC", {{"device", "cpu"}}); }), ErrorKind::kConfig);
}

// The driver looks an address range up in the current GPU's context only: registering memory of
// another GPU than the current one must still find its allocation (it failed with
// "cuMemGetAddressRange(...) failed with CUDA driver error 500" before).
TEST(CudaIpc, RegistersMemoryOfAGpuThatIsNotCurrent) {
  REFIT_REQUIRE_GPUS(2);
  for (int memory_gpu : {0, 1}) {
    const int other = 1 - memory_gpu;
    cuda_ok(cudaSetDevice(other), "cudaSetDevice");
    DeviceBuffer big(Device{Device::Kind::kCuda, memory_gpu}, 8 << 20);
    fill_device(big.data() + kInteriorOffset, kInteriorBytes, 5);
    for (int transport_gpu : {memory_gpu, other}) {
      auto source = ipc_on(transport_gpu);
      auto destination = ipc_on(other);
      RegionId interior = source->register_memory(big.data() + kInteriorOffset, kInteriorBytes);
      int current = -1;
      cuda_ok(cudaGetDevice(&current), "cudaGetDevice");
      EXPECT_EQ(current, other);  // the caller's GPU is restored
      auto local = destination->allocate_memory(kInteriorBytes);
      PeerId peer = destination->connect(source->address(), "source rank 0");
      destination->read(peer, source->describe(interior), 0, local.base, local.region, kInteriorBytes,
                        deadline_after(30s));
      EXPECT_EQ(read_device(local.base, kInteriorBytes), pattern(kInteriorBytes, 5));
      destination->disconnect(peer);
    }
  }
  cuda_ok(cudaSetDevice(0), "cudaSetDevice");
}

// ---- two processes ----

// Publishes two allocated buffers and one region registered inside a larger allocation, then
// serves a destination until it says "done". args: device index.
REFIT_PEER_ROLE(ipc_source) {
  Channel& peer = *channels.at(0);
  auto transport = ipc_on(std::stoi(args.at(0)));
  auto a = transport->allocate_memory(kBufferBytes);
  auto b = transport->allocate_memory(kBufferBytes);
  fill_device(a.base, kBufferBytes, 1);
  fill_device(b.base, kBufferBytes, 2);
  DeviceBuffer big(Device{Device::Kind::kCuda, std::stoi(args.at(0))}, 8 << 20);
  fill_device(big.data() + kInteriorOffset, kInteriorBytes, 3);
  RegionId interior = transport->register_memory(big.data() + kInteriorOffset, kInteriorBytes);
  peer.put(transport->address());
  peer.put_region(transport->describe(a.region));
  peer.put_region(transport->describe(b.region));
  peer.put_region(transport->describe(interior));
  PeerId destination = transport->connect(peer.get(), "destination rank 0");
  if (channels.size() > 1) channels[1]->put(std::string("ready"));
  Bytes done = transport->receive(destination, deadline_after(120s));
  require(done == Bytes{'d', 'o', 'n', 'e'}, "expected 'done'");
  transport->send(destination, Bytes{'b', 'y', 'e'}, deadline_after(30s));
  peer.get_text();  // the destination has its answer
}

// Reads everything the source published and checks it bitwise. args: device index.
REFIT_PEER_ROLE(ipc_destination) {
  Channel& peer = *channels.at(0);
  auto transport = ipc_on(std::stoi(args.at(0)));
  auto local = transport->allocate_memory(2 * kBufferBytes);
  peer.put(transport->address());
  Bytes address = peer.get();
  RemoteRegion a = peer.get_region(), b = peer.get_region(), interior = peer.get_region();
  PeerId source = transport->connect(address, "source rank 0");
  auto deadline = [] { return deadline_after(60s); };
  // Read twice: the second read uses the cached mapping.
  for (int round = 0; round < 2; ++round) {
    transport->read(source, a, 0, local.base, local.region, kBufferBytes, deadline());
    require_equal(read_device(local.base, kBufferBytes), pattern(kBufferBytes, 1), "buffer a");
  }
  transport->read(source, b, 12345, local.base + kBufferBytes, local.region, (1 << 20) + 3, deadline());
  require_equal(read_device(local.base + kBufferBytes, (1 << 20) + 3),
                slice(pattern(kBufferBytes, 2), 12345, (1 << 20) + 3), "part of buffer b");
  transport->read(source, interior, 0, local.base, local.region, kInteriorBytes, deadline());
  require_equal(read_device(local.base, kInteriorBytes), pattern(kInteriorBytes, 3), "the interior region");
  transport->read(source, b, 0, local.base, local.region, 0, deadline());  // nothing, no error
  // A peer that claims more bytes than its GPU allocation holds is refused before any copy.
  RemoteRegion forged = interior;
  forged.length = 8 << 20;  // the whole 8 MiB allocation, but starting at the interior offset
  try {
    transport->read(source, forged, 0, local.base, local.region, 1, deadline());
    throw std::runtime_error("a region reaching past its GPU allocation was read");
  } catch (const Error& e) {
    require(e.kind() == ErrorKind::kProtocol, std::string("expected kProtocol, got: ") + e.what());
    require(std::string(e.what()).find("of a GPU allocation of 8388608 bytes") != std::string::npos, e.what());
  }
  transport->send(source, Bytes{'d', 'o', 'n', 'e'}, deadline());
  require(transport->receive(source, deadline()) == Bytes{'b', 'y', 'e'}, "expected 'bye'");
  transport->disconnect(source);
  peer.put(std::string("finished"));
}

void run_pair(int source_device, int destination_device) {
  auto [s, d] = socket_pair();
  Peer source("ipc_source", {s}, {std::to_string(source_device)});
  Peer destination("ipc_destination", {d}, {std::to_string(destination_device)});
  EXPECT_EQ(destination.wait(), 0);
  EXPECT_EQ(source.wait(), 0);
}

TEST(CudaIpcProcesses, ReadsBetweenTwoProcessesOnOneGpuBitwise) {
  REFIT_REQUIRE_GPUS(1);
  run_pair(0, 0);
}

TEST(CudaIpcProcesses, ReadsAcrossGpusBitwise) {
  REFIT_REQUIRE_GPUS(2);
  run_pair(0, 1);
  run_pair(1, 0);
}

// Reads once, reports, then expects its source to be killed. args: device index.
REFIT_PEER_ROLE(ipc_destination_of_a_dying_source) {
  Channel& peer = *channels.at(0);
  Channel& test = *channels.at(1);
  auto transport = ipc_on(std::stoi(args.at(0)));
  auto local = transport->allocate_memory(kBufferBytes);
  peer.put(transport->address());
  Bytes address = peer.get();
  RemoteRegion a = peer.get_region();
  peer.get_region();
  peer.get_region();
  PeerId source = transport->connect(address, "source rank 0");
  transport->read(source, a, 0, local.base, local.region, kBufferBytes, deadline_after(60s));
  require_equal(read_device(local.base, kBufferBytes), pattern(kBufferBytes, 1), "buffer a");
  test.put(std::string("read"));
  require(test.get_text() == "killed", "expected 'killed'");
  const auto start = Clock::now();
  try {
    transport->receive(source, deadline_after(60s));
    throw std::runtime_error("receive from a killed source returned");
  } catch (const Error& e) {
    require(e.kind() == ErrorKind::kPeerLost, std::string("expected kPeerLost, got: ") + e.what());
    require(std::string(e.what()).find("source rank 0") != std::string::npos, "the error does not name the source");
  }
  require(Clock::now() - start < 10s, "the loss was not reported promptly");
  try {
    transport->read(source, a, 0, local.base, local.region, 1024, deadline_after(60s));
    throw std::runtime_error("a read from a killed source succeeded");
  } catch (const Error& e) {
    require(e.kind() == ErrorKind::kPeerLost, std::string("expected kPeerLost, got: ") + e.what());
  }
}

TEST(CudaIpcProcesses, AKilledSourceIsReportedPromptly) {
  REFIT_REQUIRE_GPUS(1);
  auto [s, d] = socket_pair();
  auto [s_test, s_here] = socket_pair();
  auto [d_test, d_here] = socket_pair();
  Channel source_channel(s_here), destination_channel(d_here);
  Peer source("ipc_source", {s, s_test}, {"0"});
  Peer destination("ipc_destination_of_a_dying_source", {d, d_test}, {"0"});
  EXPECT_EQ(source_channel.get_text(), "ready");
  EXPECT_EQ(destination_channel.get_text(), "read");
  source.kill();
  destination_channel.put(std::string("killed"));
  EXPECT_EQ(destination.wait(), 0);
}

}  // namespace
}  // namespace refit
