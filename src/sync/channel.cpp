#include "sync/channel.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "core/fail.h"

namespace refit {

namespace {
constexpr uint64_t kMaxFrame = 1ull << 32;  // metadata of thousands of workers still fits
}

Channel::~Channel() { close(); }

Channel::Channel(Channel&& other) noexcept : fd_(std::exchange(other.fd_, -1)), peer_(std::move(other.peer_)) {}

Channel& Channel::operator=(Channel&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = std::exchange(other.fd_, -1);
    peer_ = std::move(other.peer_);
  }
  return *this;
}

void Channel::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void Channel::send(const nlohmann::json& message) {
  auto body = nlohmann::json::to_cbor(message);
  uint64_t size = body.size();
  std::vector<uint8_t> frame(sizeof(size) + body.size());
  std::memcpy(frame.data(), &size, sizeof(size));
  std::memcpy(frame.data() + sizeof(size), body.data(), body.size());
  size_t sent = 0;
  while (sent < frame.size()) {
    ssize_t n = ::send(fd_, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(ErrorKind::kPeerLost, "cannot send to {}: {}", peer_, std::strerror(errno));
    sent += static_cast<size_t>(n);
  }
}

bool Channel::read_exact(void* out, size_t n, Deadline deadline, bool forever) {
  auto* p = static_cast<uint8_t*>(out);
  size_t got = 0;
  while (got < n) {
    int wait_ms = -1;
    if (!forever) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return false;
      wait_ms = static_cast<int>(std::min<int64_t>(left, 1000));
    }
    pollfd pfd{fd_, POLLIN, 0};
    int r = poll(&pfd, 1, wait_ms);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) fail(ErrorKind::kIo, "poll on the channel to {}: {}", peer_, std::strerror(errno));
    if (r == 0) continue;
    ssize_t k = ::recv(fd_, p + got, n - got, 0);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (k <= 0) fail(ErrorKind::kPeerLost, "{} closed its channel{}", peer_, k < 0 ? fmt::format(" ({})", std::strerror(errno)) : "");
    got += static_cast<size_t>(k);
  }
  return true;
}

nlohmann::json Channel::receive_frame(Deadline deadline, bool forever) {
  uint64_t size = 0;
  if (!read_exact(&size, sizeof(size), deadline, forever))
    fail(ErrorKind::kTimeout, "no answer from {} before the deadline", peer_);
  if (size > kMaxFrame) fail(ErrorKind::kProtocol, "{} sent a frame of {} bytes", peer_, size);
  std::vector<uint8_t> body(size);
  if (!read_exact(body.data(), size, deadline, forever)) fail(ErrorKind::kTimeout, "{} stopped mid-message", peer_);
  try {
    return nlohmann::json::from_cbor(body);
  } catch (const nlohmann::json::exception& e) {
    fail(ErrorKind::kProtocol, "garbled message from {}: {}", peer_, e.what());
  }
}

nlohmann::json Channel::receive(Deadline deadline) { return receive_frame(deadline, false); }
nlohmann::json Channel::receive_forever() { return receive_frame({}, true); }

}  // namespace refit
