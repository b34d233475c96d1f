#include "sync/tcp.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "core/fail.h"

namespace refit {
namespace {

struct AddressList {
  addrinfo* head = nullptr;
  ~AddressList() {
    if (head) freeaddrinfo(head);
  }
};

void resolve(const std::string& host, int port, bool passive, AddressList& out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  const std::string service = std::to_string(port);
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &out.head);
  if (rc != 0) fail(ErrorKind::kIo, "cannot resolve {}:{}: {}", host, port, gai_strerror(rc));
}

// Small control messages go out at once. A peer that stops answering is given up after about the
// deadline (keepalive probes while idle, a user timeout while data waits), so that a worker whose
// driver's host vanished exits instead of waiting on a connection that will never speak again,
// while a partition that heals within the deadline goes unnoticed.
void tune(int fd, double timeout_s) {
  int one = 1;
  int idle = std::max(1, static_cast<int>(timeout_s / 3));
  int interval = std::max(1, static_cast<int>(timeout_s / 6));
  int count = 3;
  unsigned user_timeout_ms = static_cast<unsigned>(std::max(1.0, timeout_s) * 1000);
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof user_timeout_ms);
}

constexpr std::chrono::seconds kAttempt{2};

int milliseconds_left(Deadline deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, 200));
}

}  // namespace

int tcp_listen(const std::string& host, int port) {
  AddressList addresses;
  resolve(host, port, true, addresses);
  std::string last_error = "no address";
  for (addrinfo* a = addresses.head; a; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 1024) == 0) return fd;
    last_error = std::strerror(errno);
    ::close(fd);
  }
  fail(ErrorKind::kIo, "cannot listen at {}:{}: {}", host, port, last_error);
}

int tcp_accept(int listener, Deadline deadline, double timeout_s) {
  while (true) {
    pollfd p{listener, POLLIN, 0};
    if (::poll(&p, 1, milliseconds_left(deadline)) > 0) {
      int fd = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) {
        tune(fd, timeout_s);
        return fd;
      }
      if (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED)
        fail(ErrorKind::kIo, "accepting a connection: {}", std::strerror(errno));
    }
    if (expired(deadline)) fail(ErrorKind::kTimeout, "no connection arrived before the deadline");
  }
}

int tcp_connect(const std::string& host, int port, Deadline deadline, double timeout_s) {
  std::string last_error = "no address";
  while (true) {
    AddressList addresses;
    resolve(host, port, false, addresses);
    for (addrinfo* a = addresses.head; a; a = a->ai_next) {
      int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
      if (fd < 0) continue;
      int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        // One attempt lasts at most kAttempt: a SYN lost while a link was down is otherwise
        // retried by the kernel only after 1, 3, 7, 15, 31 s, long after the link came back.
        const Deadline attempt = std::min(deadline, deadline_after(kAttempt));
        pollfd p{fd, POLLOUT, 0};
        while ((rc = ::poll(&p, 1, milliseconds_left(attempt))) == 0 && !expired(attempt)) {
        }
        int error = rc > 0 ? 0 : ETIMEDOUT;
        socklen_t length = sizeof error;
        if (rc > 0) getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length);
        rc = error == 0 ? 0 : -1;
        errno = error;
      }
      if (rc == 0) {
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
        tune(fd, timeout_s);
        return fd;
      }
      last_error = std::strerror(errno);
      ::close(fd);
    }
    if (expired(deadline)) fail(ErrorKind::kTimeout, "{}", last_error);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

}  // namespace refit
