// Forked peer processes for the transport tests: a Child runs `body` in a forked process (no exec:
// CPU transports only) and talks to the test over a Pipe of length-prefixed records.
#pragma once

#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>

#include "refit/ext/transport.h"

namespace refit::testing {

// Length-prefixed blobs over one end of a socketpair.
class Pipe {
 public:
  explicit Pipe(int fd) : fd_(fd) {}
  ~Pipe() { ::close(fd_); }
  Pipe(const Pipe&) = delete;
  Pipe& operator=(const Pipe&) = delete;

  void put(std::span<const uint8_t> bytes) {
    uint64_t size = bytes.size();
    write_all(&size, sizeof(size));
    write_all(bytes.data(), bytes.size());
  }
  void put(const std::string& text) { put({reinterpret_cast<const uint8_t*>(text.data()), text.size()}); }

  Bytes get() {
    uint64_t size = 0;
    read_all(&size, sizeof(size));
    Bytes bytes(size);
    read_all(bytes.data(), size);
    return bytes;
  }
  std::string get_text() {
    Bytes bytes = get();
    return {bytes.begin(), bytes.end()};
  }
  void put_byte(uint8_t b) { put(std::span<const uint8_t>(&b, 1)); }
  uint8_t get_byte() {
    Bytes bytes = get();
    if (bytes.size() != 1) throw std::runtime_error("expected a one-byte record from the peer process");
    return bytes[0];
  }

  void put_region(const RemoteRegion& region) {
    Bytes bytes(16);
    std::memcpy(bytes.data(), &region.address, 8);
    std::memcpy(bytes.data() + 8, &region.length, 8);
    bytes.insert(bytes.end(), region.key.begin(), region.key.end());
    put(bytes);
  }
  RemoteRegion get_region() {
    Bytes bytes = get();
    RemoteRegion region;
    std::memcpy(&region.address, bytes.data(), 8);
    std::memcpy(&region.length, bytes.data() + 8, 8);
    region.key.assign(bytes.begin() + 16, bytes.end());
    return region;
  }

 private:
  void write_all(const void* data, size_t size) {
    const auto* p = static_cast<const uint8_t*>(data);
    while (size > 0) {
      ssize_t n = ::write(fd_, p, size);
      if (n <= 0) throw std::runtime_error("pipe to the peer process closed");
      p += n;
      size -= static_cast<size_t>(n);
    }
  }
  void read_all(void* data, size_t size) {
    auto* p = static_cast<uint8_t*>(data);
    while (size > 0) {
      ssize_t n = ::read(fd_, p, size);
      if (n <= 0) throw std::runtime_error("pipe from the peer process closed");
      p += n;
      size -= static_cast<size_t>(n);
    }
  }

  int fd_;
};

// Throws in the child, where gtest assertions would not reach the parent.
inline void require(bool condition, const std::string& what) {
  if (!condition) throw std::runtime_error(what);
}

// A forked peer process running `body`; it exits 0 when `body` returns.
class Child {
 public:
  explicit Child(const std::function<void(Pipe&)>& body) {
    int fds[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) throw std::runtime_error("socketpair failed");
    const pid_t parent = getpid();
    pid_ = fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      // Dies with the test process (the forking thread, here the test's), even a stopped child: one
      // that outlived an aborted test would hold the test's output open, and ctest would wait for
      // it until its timeout.
      if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent) _exit(2);
      ::close(fds[0]);
      int status = 0;
      try {
        Pipe pipe(fds[1]);
        body(pipe);
      } catch (const std::exception& e) {
        std::cerr << "child process failed: " << e.what() << std::endl;
        status = 1;
      }
      _exit(status);  // skip gtest's and the parent's exit handlers
    }
    ::close(fds[1]);
    pipe_ = std::make_unique<Pipe>(fds[0]);
  }
  ~Child() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }

  Pipe& pipe() { return *pipe_; }

  // The child's exit code, or -signal if a signal ended it.
  int wait() {
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
  }
  void kill() {
    ::kill(pid_, SIGKILL);
    wait();
  }
  // Returns once the child is stopped, not merely signalled.
  void stop() {
    ::kill(pid_, SIGSTOP);
    int status = 0;
    waitpid(pid_, &status, WUNTRACED);
  }

 private:
  pid_t pid_ = -1;
  std::unique_ptr<Pipe> pipe_;
};

}  // namespace refit::testing
