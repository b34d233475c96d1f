// Helpers of the GPU tests: skipping without a GPU, byte patterns, device fills and checks, and
// peer processes. A peer process is this test binary started again (fork + exec, so that it
// gets a fresh CUDA driver: CUDA does not survive fork) in the role a test names; it talks to
// the test over socket pairs passed as descriptors 3, 4, ...
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/error_of.h"
#include "refit/device.h"
#include "refit/error.h"
#include "refit/ext/transport.h"

namespace refit::gpu_test {

// Skips the test unless this machine has at least `count` usable GPUs. With REFIT_REQUIRE_GPU=1
// in the environment (scripts/gpu_test.sh sets it) a machine without any usable GPU fails instead,
// so that a broken driver cannot pass as "all skipped".
#define REFIT_REQUIRE_GPUS(count)                                                                               \
  do {                                                                                                          \
    std::string refit_reason;                                                                                   \
    int refit_gpus = ::refit::cuda_device_count(&refit_reason);                                                 \
    if (refit_gpus == 0 && ::refit::gpu_test::gpu_required())                                                   \
      FAIL() << "REFIT_REQUIRE_GPU is set but no GPU is usable: " << refit_reason;                              \
    if (refit_gpus < (count))                                                                                   \
      GTEST_SKIP() << "needs " << (count) << " GPU(s), this machine has " << refit_gpus << " (" << refit_reason \
                   << ")";                                                                                      \
  } while (0)

bool gpu_required();

// Throws std::runtime_error naming the call unless it succeeded (for test set-up code).
void cuda_ok(cudaError_t status, const char* call);

using ::refit::testing::error_kind_of;

// Position-dependent bytes; `seed` makes buffers differ.
std::vector<uint8_t> pattern(size_t size, uint64_t seed);
// Writes pattern(size, seed) to device memory; reads device memory back to the host.
void fill_device(void* device, size_t size, uint64_t seed);
std::vector<uint8_t> read_device(const void* device, size_t size);
// Throws std::runtime_error naming the first differing byte (for peer processes).
void require_equal(const std::vector<uint8_t>& got, const std::vector<uint8_t>& expected, const std::string& what);
void require(bool condition, const std::string& what);

// Length-prefixed blobs over a socket; every wait has a deadline.
class Channel {
 public:
  explicit Channel(int fd) : fd_(fd) {}
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  void put(std::span<const uint8_t> bytes);
  void put(const std::string& text) { put({reinterpret_cast<const uint8_t*>(text.data()), text.size()}); }
  Bytes get(double timeout_s = 120);
  std::string get_text(double timeout_s = 120);
  void put_region(const RemoteRegion& region);
  RemoteRegion get_region(double timeout_s = 120);

 private:
  void write_all(const void* data, size_t size);
  void read_all(void* data, size_t size, double timeout_s);
  int fd_;
};

// A peer role: runs in its own process with its channels (fd 3, 4, ... in order) and its args.
using PeerRole = std::function<void(std::vector<std::unique_ptr<Channel>>& channels, std::vector<std::string> args)>;
// Roles register themselves at static initialization: REFIT_PEER_ROLE(name) { ... }.
std::map<std::string, PeerRole>& peer_roles();
struct RegisterRole {
  RegisterRole(const std::string& name, PeerRole role) { peer_roles()[name] = std::move(role); }
};
#define REFIT_PEER_ROLE(name)                                                                                          \
  static void name(std::vector<std::unique_ptr<::refit::gpu_test::Channel>>& channels, std::vector<std::string> args); \
  static ::refit::gpu_test::RegisterRole name##_registered(#name, name);                                               \
  static void name([[maybe_unused]] std::vector<std::unique_ptr<::refit::gpu_test::Channel>>& channels,                \
                   [[maybe_unused]] std::vector<std::string> args)

// Runs a role if argv asks for one (gpu_main.cpp); returns the exit code, or -1 when not a peer.
int run_peer_if_asked(int argc, char** argv);

// A peer process. `fds` are passed as descriptors 3, 4, ... and closed here.
class Peer {
 public:
  Peer(const std::string& role, std::vector<int> fds, std::vector<std::string> args = {});
  ~Peer();  // kills it if still running
  Peer(const Peer&) = delete;
  Peer& operator=(const Peer&) = delete;

  // Its exit code (or -signal); kills it and returns -9 past the timeout.
  int wait(double timeout_s = 240);
  void kill();
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
};

// A connected socket pair.
std::pair<int, int> socket_pair();

}  // namespace refit::gpu_test
