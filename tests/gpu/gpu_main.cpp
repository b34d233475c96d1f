// The GPU test binary's main and shared helpers. Started as
//   refit_gpu_tests --refit-gpu-peer ROLE NFDS [ARGS...]
// it runs a peer role instead of the tests (see gpu_test_util.h).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <stdexcept>
#include <thread>

#include "gpu_test_util.h"

namespace refit::gpu_test {

bool gpu_required() {
  const char* value = std::getenv("REFIT_REQUIRE_GPU");
  return value != nullptr && std::string(value) == "1";
}

void cuda_ok(cudaError_t status, const char* call) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string(call) + ": " + cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
}

std::vector<uint8_t> pattern(size_t size, uint64_t seed) {
  std::vector<uint8_t> bytes(size);
  for (size_t i = 0; i < size; i += 8) {
    uint64_t word = (i / 8 + seed * 0x1000193ull) * 0x9E3779B97F4A7C15ull;
    std::memcpy(bytes.data() + i, &word, std::min<size_t>(8, size - i));
  }
  return bytes;
}

void fill_device(void* device, size_t size, uint64_t seed) {
  std::vector<uint8_t> host = pattern(size, seed);
  cuda_ok(cudaMemcpy(device, host.data(), size, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
}

std::vector<uint8_t> read_device(const void* device, size_t size) {
  std::vector<uint8_t> host(size);
  cuda_ok(cudaMemcpy(host.data(), device, size, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  return host;
}

void require(bool condition, const std::string& what) {
  if (!condition) throw std::runtime_error(what);
}

void require_equal(const std::vector<uint8_t>& got, const std::vector<uint8_t>& expected, const std::string& what) {
  if (got.size() != expected.size())
    throw std::runtime_error(what + ": " + std::to_string(got.size()) + " bytes, expected " +
                             std::to_string(expected.size()));
  auto mismatch = std::mismatch(got.begin(), got.end(), expected.begin());
  if (mismatch.first != got.end())
    throw std::runtime_error(what + ": first difference at byte " + std::to_string(mismatch.first - got.begin()));
}

Channel::~Channel() { ::close(fd_); }

void Channel::put(std::span<const uint8_t> bytes) {
  uint64_t size = bytes.size();
  write_all(&size, sizeof(size));
  write_all(bytes.data(), bytes.size());
}

Bytes Channel::get(double timeout_s) {
  uint64_t size = 0;
  read_all(&size, sizeof(size), timeout_s);
  Bytes bytes(size);
  read_all(bytes.data(), size, timeout_s);
  return bytes;
}

std::string Channel::get_text(double timeout_s) {
  Bytes bytes = get(timeout_s);
  return {bytes.begin(), bytes.end()};
}

void Channel::put_region(const RemoteRegion& region) {
  Bytes bytes(16);
  std::memcpy(bytes.data(), &region.address, 8);
  std::memcpy(bytes.data() + 8, &region.length, 8);
  bytes.insert(bytes.end(), region.key.begin(), region.key.end());
  put(bytes);
}

RemoteRegion Channel::get_region(double timeout_s) {
  Bytes bytes = get(timeout_s);
  require(bytes.size() >= 16, "short region descriptor");
  RemoteRegion region;
  std::memcpy(&region.address, bytes.data(), 8);
  std::memcpy(&region.length, bytes.data() + 8, 8);
  region.key.assign(bytes.begin() + 16, bytes.end());
  return region;
}

void Channel::write_all(const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    ssize_t n = ::send(fd_, p, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw std::runtime_error("test channel closed while writing");
    p += n;
    size -= static_cast<size_t>(n);
  }
}

void Channel::read_all(void* data, size_t size, double timeout_s) {
  auto* p = static_cast<uint8_t*>(data);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (size > 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) throw std::runtime_error("timed out reading the test channel");
    pollfd pfd{fd_, POLLIN, 0};
    if (::poll(&pfd, 1, static_cast<int>(left.count())) <= 0) continue;
    ssize_t n = ::read(fd_, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw std::runtime_error("test channel closed while reading (the peer process ended)");
    p += n;
    size -= static_cast<size_t>(n);
  }
}

std::map<std::string, PeerRole>& peer_roles() {
  static std::map<std::string, PeerRole> roles;
  return roles;
}

int run_peer_if_asked(int argc, char** argv) {
  if (argc < 4 || std::string(argv[1]) != "--refit-gpu-peer") return -1;
  const std::string role = argv[2];
  const int fds = std::stoi(argv[3]);
  std::vector<std::unique_ptr<Channel>> channels;
  for (int i = 0; i < fds; ++i) channels.push_back(std::make_unique<Channel>(3 + i));
  std::vector<std::string> args(argv + 4, argv + argc);
  auto it = peer_roles().find(role);
  if (it == peer_roles().end()) {
    std::cerr << "unknown peer role " << role << std::endl;
    return 2;
  }
  try {
    it->second(channels, std::move(args));
  } catch (const std::exception& e) {
    std::cerr << "peer " << role << " (pid " << getpid() << ") failed: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}

std::pair<int, int> socket_pair() {
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) throw std::runtime_error("socketpair failed");
  return {fds[0], fds[1]};
}

Peer::Peer(const std::string& role, std::vector<int> fds, std::vector<std::string> args) {
  // Everything the child needs is built before fork: between fork and exec it may only make
  // async-signal-safe calls (the CUDA runtime's threads may hold the allocator's lock).
  std::vector<std::string> argv_strings = {"/proc/self/exe", "--refit-gpu-peer", role, std::to_string(fds.size())};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : argv_strings) argv.push_back(s.data());
  argv.push_back(nullptr);
  std::vector<int> high(fds.size(), -1);
  pid_ = fork();
  if (pid_ < 0) throw std::runtime_error("fork failed");
  if (pid_ == 0) {
    // Move the descriptors to 3, 4, ... without clobbering one another, then exec ourselves.
    for (size_t i = 0; i < fds.size(); ++i) high[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 100);
    for (size_t i = 0; i < high.size(); ++i) dup2(high[i], 3 + static_cast<int>(i));  // dup2 clears CLOEXEC
    execv("/proc/self/exe", argv.data());
    _exit(127);
  }
  for (int fd : fds) ::close(fd);
}

Peer::~Peer() {
  if (pid_ > 0) kill();
}

int Peer::wait(double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (true) {
    int status = 0;
    pid_t done = waitpid(pid_, &status, WNOHANG);
    if (done == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      kill();
      return -9;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

void Peer::kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

}  // namespace refit::gpu_test

int main(int argc, char** argv) {
  int peer = refit::gpu_test::run_peer_if_asked(argc, argv);
  if (peer >= 0) return peer;
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
