#include "transport/local_socket/local_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "core/fail.h"
#include "core/process_identity.h"
#include "core/wire.h"
#include "transport/local_socket/control_frame.h"

namespace refit {
namespace {

using control_frame::FrameType;

constexpr auto kByeTimeout = std::chrono::milliseconds(200);
constexpr size_t kReadChunk = 1 << 16;

std::string socket_name_of(std::string_view tag, const EndpointId& id) {
  return fmt::format("refit-{}-{}", tag, to_hex(id));
}

sockaddr_un abstract_address(const std::string& name, socklen_t* length) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (name.size() + 1 > sizeof(address.sun_path))
    fail(ErrorKind::kInternal, "socket name '{}' is too long for a Unix socket address", name);
  address.sun_path[0] = '\0';  // abstract namespace: no file, gone with the last descriptor
  std::memcpy(address.sun_path + 1, name.data(), name.size());
  *length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return address;
}

// Milliseconds until the deadline for poll(), at least 0 and at most a minute per call.
int poll_timeout_ms(Deadline deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  if (left <= 0) return 0;
  return static_cast<int>(std::min<int64_t>(left + 1, 60'000));
}

enum class WriteResult { kDone, kTimeout, kClosed };

// Writes all of `iov` on a non-blocking socket before the deadline. `written` reports how many
// bytes went out (a timeout after some bytes leaves a torn frame on the stream).
WriteResult write_all(int fd, std::vector<iovec> iov, Deadline deadline, size_t* written, int* error) {
  *written = 0;
  size_t first = 0;
  while (first < iov.size()) {
    msghdr message{};
    message.msg_iov = iov.data() + first;
    message.msg_iovlen = iov.size() - first;
    ssize_t n = ::sendmsg(fd, &message, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (expired(deadline)) return WriteResult::kTimeout;
        pollfd p{fd, POLLOUT, 0};
        ::poll(&p, 1, poll_timeout_ms(deadline));
        continue;
      }
      *error = errno;
      return WriteResult::kClosed;
    }
    *written += static_cast<size_t>(n);
    auto left = static_cast<size_t>(n);
    while (first < iov.size() && left >= iov[first].iov_len) {
      left -= iov[first].iov_len;
      ++first;
    }
    if (first < iov.size()) {
      iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
  return WriteResult::kDone;
}

// An outbound connection: we write, the peer never does; reading it only tells us it closed.
struct Link {
  ~Link() {
    if (fd >= 0) ::close(fd);
  }
  int fd = -1;
  EndpointId peer{};
  std::string label;
  std::mutex send_mutex;  // one frame at a time
  // Under the endpoint's mutex:
  bool closed = false;  // the peer closed its end (it exited or was killed)
  std::string broken;   // set when a send timed out mid-frame: the stream is torn
};

// An accepted connection: the peer writes, we read frames.
struct Inbound {
  ~Inbound() {
    if (fd >= 0) ::close(fd);
  }
  int fd = -1;
  bool introduced = false;
  EndpointId sender{};
  bool said_bye = false;
  Bytes buffer;
  size_t consumed = 0;
};

struct Sender {
  std::map<uint8_t, std::deque<Bytes>> queues;
  int open = 0;          // open connections from this sender
  bool crashed = false;  // a connection from it ended without BYE: it is gone for good
};

}  // namespace

struct LocalSocketEndpoint::State {
  EndpointId id{};
  std::string tag;
  int listen_fd = -1;
  int wake_read = -1;
  int wake_write = -1;
  std::thread thread;
  std::atomic<bool> stopping{false};

  std::mutex mutex;
  std::condition_variable changed;
  uint64_t activity = 0;                          // moves with every notify of `changed`; under mutex
  std::map<LinkId, std::shared_ptr<Link>> links;  // under mutex
  LinkId next_link = 1;                           // under mutex
  std::map<EndpointId, Sender> senders;           // under mutex
  std::map<uint8_t, Handler> handlers;            // under mutex
  std::vector<std::unique_ptr<Inbound>> inbound;  // the thread's own

  void wake() {
    uint8_t byte = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_write, &byte, 1);
  }

  std::shared_ptr<Link> find(LinkId link, std::string_view doing) {
    std::lock_guard lock(mutex);
    auto it = links.find(link);
    if (it == links.end()) fail(ErrorKind::kInvalidArgument, "{}: control link {} is not connected", doing, link);
    return it->second;
  }

  // The next queued message from `link`'s peer on `channel`, if any; under `mutex`.
  std::optional<Bytes> pop(const Link& link, uint8_t channel) {
    auto& queue = senders[link.peer].queues[channel];
    if (queue.empty()) return std::nullopt;
    Bytes message = std::move(queue.front());
    queue.pop_front();
    return message;
  }

  // Why the link's peer is gone, or empty. Under mutex.
  // A peer that disconnected on purpose (BYE) may connect again and is not lost; one whose
  // connection to us ended without BYE is (only the kernel closes a socket that way: the process
  // died), and so is one that closed our connection to it (it died, or destroyed its endpoint).
  std::string lost_reason(const Link& link) {
    if (link.closed) return "its control connection closed (the peer shut down, exited or was killed)";
    auto it = senders.find(link.peer);
    if (it != senders.end() && it->second.crashed)
      return "its control connection closed without a goodbye (the process exited or was killed)";
    return {};
  }

  void run();
  void accept_all();
  // Reads what is there; false when the connection is finished (closed or malformed).
  struct HandledMessage {
    Handler handler;
    EndpointId sender;
    Bytes message;
  };
  bool read_inbound(Inbound& in, std::vector<HandledMessage>& handled);
  void close_inbound(Inbound& in, const std::string& why);
  void watch_link(const std::shared_ptr<Link>& link);
};

std::string to_hex(std::span<const uint8_t> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (uint8_t b : bytes) {
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 15]);
  }
  return out;
}

LocalSocketEndpoint::LocalSocketEndpoint(std::string_view tag) : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.id = random_id();
  s.tag = std::string(tag);
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) != 0)
    fail(ErrorKind::kTransport, "cannot create the control channel's wake-up pipe: {}", std::strerror(errno));
  s.wake_read = pipe_fds[0];
  s.wake_write = pipe_fds[1];
  s.listen_fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (s.listen_fd < 0) {
    int e = errno;
    ::close(s.wake_read);
    ::close(s.wake_write);
    fail(ErrorKind::kTransport, "cannot create the control socket: {}", std::strerror(e));
  }
  socklen_t length = 0;
  const std::string name = socket_name_of(s.tag, s.id);
  sockaddr_un address = abstract_address(name, &length);
  if (::bind(s.listen_fd, reinterpret_cast<sockaddr*>(&address), length) != 0 || ::listen(s.listen_fd, 64) != 0) {
    int e = errno;
    ::close(s.listen_fd);
    ::close(s.wake_read);
    ::close(s.wake_write);
    fail(ErrorKind::kTransport, "cannot listen on the control socket @{}: {}", name, std::strerror(e));
  }
  s.thread = std::thread([&s] { s.run(); });
}

namespace {

// Tells the peer we are leaving on purpose (a BYE frame), best effort within kByeTimeout; the
// caller holds the link's send lock.
void say_bye(const Link& link) {
  Bytes frame = control_frame::encode_header(FrameType::kBye, 0, 0);
  size_t written = 0;
  int error = 0;
  write_all(link.fd, {iovec{frame.data(), frame.size()}}, deadline_after(kByeTimeout), &written, &error);
}

}  // namespace

LocalSocketEndpoint::~LocalSocketEndpoint() {
  State& s = *state_;
  s.stopping = true;
  s.wake();
  s.thread.join();
  std::map<LinkId, std::shared_ptr<Link>> links;
  {
    std::lock_guard lock(s.mutex);
    links.swap(s.links);
  }
  for (auto& [id, link] : links) {
    std::lock_guard send_lock(link->send_mutex);
    if (link->closed || !link->broken.empty()) continue;
    say_bye(*link);
  }
  links.clear();
  s.inbound.clear();
  ::close(s.listen_fd);
  ::close(s.wake_read);
  ::close(s.wake_write);
}

const EndpointId& LocalSocketEndpoint::id() const { return state_->id; }
const std::string& LocalSocketEndpoint::tag() const { return state_->tag; }
std::string LocalSocketEndpoint::socket_name() const { return "@" + socket_name_of(state_->tag, state_->id); }

LocalSocketEndpoint::LinkId LocalSocketEndpoint::connect(const EndpointId& peer, std::string_view tag,
                                                         const std::string& label, Deadline deadline) {
  State& s = *state_;
  const std::string name = socket_name_of(tag, peer);
  auto link = std::make_shared<Link>();
  link->peer = peer;
  link->label = label;
  link->fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (link->fd < 0)
    fail(ErrorKind::kTransport, "cannot create a control socket to {}: {}", label, std::strerror(errno));
  socklen_t length = 0;
  sockaddr_un address = abstract_address(name, &length);
  while (::connect(link->fd, reinterpret_cast<sockaddr*>(&address), length) != 0) {
    const int e = errno;
    if (e == EINTR) continue;
    if (e == EAGAIN) {  // the listener's backlog is full: it has not caught up yet
      if (expired(deadline))
        fail(ErrorKind::kTimeout, "timed out connecting to {} at @{}: it does not accept", label, name);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    if (e == ECONNREFUSED || e == ENOENT) {
      fail(ErrorKind::kPeerLost,
           "cannot reach {}: nothing listens on its control socket @{} (the process exited, or runs on another host "
           "or in another network namespace)",
           label, name);
    }
    fail(ErrorKind::kTransport, "cannot connect to {} at @{}: {}", label, name, std::strerror(e));
  }
  Bytes hello = control_frame::encode_hello(s.id, peer);
  size_t written = 0;
  int error = 0;
  switch (write_all(link->fd, {iovec{hello.data(), hello.size()}}, deadline, &written, &error)) {
    case WriteResult::kDone:
      break;
    case WriteResult::kTimeout:
      fail(ErrorKind::kTimeout, "timed out introducing ourselves to {} at @{}", label, name);
    case WriteResult::kClosed:
      fail(ErrorKind::kPeerLost, "lost {} while connecting to it at @{}: {}", label, name, std::strerror(error));
  }
  LinkId id;
  {
    std::lock_guard lock(s.mutex);
    id = s.next_link++;
    s.links.emplace(id, link);
  }
  s.wake();
  return id;
}

void LocalSocketEndpoint::disconnect(LinkId id) {
  State& s = *state_;
  std::shared_ptr<Link> link;
  {
    std::lock_guard lock(s.mutex);
    auto it = s.links.find(id);
    if (it == s.links.end()) fail(ErrorKind::kInvalidArgument, "disconnecting: control link {} is not connected", id);
    link = std::move(it->second);
    s.links.erase(it);
  }
  {
    std::lock_guard send_lock(link->send_mutex);
    bool usable;
    {
      std::lock_guard lock(s.mutex);
      usable = !link->closed && link->broken.empty();
    }
    if (usable) {
      say_bye(*link);
    }
    // The peer sees BYE then end of stream now; the descriptor closes once the thread lets go of it.
    ::shutdown(link->fd, SHUT_RDWR);
  }
  s.wake();
}

void LocalSocketEndpoint::send(LinkId id, uint8_t channel, std::span<const uint8_t> message, Deadline deadline) {
  State& s = *state_;
  std::shared_ptr<Link> link = s.find(id, "sending a control message");
  if (message.size() > kMaxMessageBytes) {
    fail(ErrorKind::kInvalidArgument, "a control message to {} of {} bytes exceeds the limit of {} bytes", link->label,
         message.size(), kMaxMessageBytes);
  }
  std::lock_guard send_lock(link->send_mutex);
  {
    std::lock_guard lock(s.mutex);
    if (!link->broken.empty())
      fail(ErrorKind::kTransport, "cannot send to {}: the control connection was torn when {}; connect again",
           link->label, link->broken);
    if (std::string why = s.lost_reason(*link); !why.empty())
      fail(ErrorKind::kPeerLost, "lost {} before sending a {}-byte message: {}", link->label, message.size(), why);
  }
  Bytes header = control_frame::encode_header(FrameType::kData, channel, message.size());
  std::vector<iovec> iov{{header.data(), header.size()}};
  if (!message.empty()) iov.push_back({const_cast<uint8_t*>(message.data()), message.size()});
  size_t written = 0;
  int error = 0;
  switch (write_all(link->fd, std::move(iov), deadline, &written, &error)) {
    case WriteResult::kDone:
      return;
    case WriteResult::kTimeout: {
      std::string what = fmt::format("a {}-byte message timed out after {} bytes", message.size(), written);
      if (written > 0) {
        std::lock_guard lock(s.mutex);
        link->broken = what;
      }
      fail(ErrorKind::kTimeout, "timed out sending a {}-byte message to {} (it does not read its control socket)",
           message.size(), link->label);
    }
    case WriteResult::kClosed: {
      std::lock_guard lock(s.mutex);
      link->closed = true;
      ++s.activity;
      s.changed.notify_all();
      fail(ErrorKind::kPeerLost, "lost {} while sending a {}-byte message: its control connection closed ({})",
           link->label, message.size(), std::strerror(error));
    }
  }
}

Bytes LocalSocketEndpoint::receive(LinkId id, uint8_t channel, Deadline deadline) {
  State& s = *state_;
  std::shared_ptr<Link> link = s.find(id, "receiving a control message");
  std::unique_lock lock(s.mutex);
  while (true) {
    if (auto message = s.pop(*link, channel)) return std::move(*message);
    if (std::string why = s.lost_reason(*link); !why.empty())
      fail(ErrorKind::kPeerLost, "lost {} while waiting for a message from it: {}", link->label, why);
    if (expired(deadline)) fail(ErrorKind::kTimeout, "timed out waiting for a message from {}", link->label);
    s.changed.wait_until(lock, deadline);
  }
}

std::optional<Bytes> LocalSocketEndpoint::try_receive(LinkId id, uint8_t channel) {
  State& s = *state_;
  std::shared_ptr<Link> link = s.find(id, "receiving a control message");
  std::lock_guard lock(s.mutex);
  if (auto message = s.pop(*link, channel)) return message;
  if (std::string why = s.lost_reason(*link); !why.empty()) fail(ErrorKind::kPeerLost, "lost {}: {}", link->label, why);
  return std::nullopt;
}

uint64_t LocalSocketEndpoint::activity() {
  std::lock_guard lock(state_->mutex);
  return state_->activity;
}

void LocalSocketEndpoint::wait_activity(uint64_t seen, Deadline deadline) {
  std::unique_lock lock(state_->mutex);
  state_->changed.wait_until(lock, deadline, [&] { return state_->activity != seen; });
}

void LocalSocketEndpoint::check_alive(LinkId id, std::string_view doing) {
  State& s = *state_;
  std::shared_ptr<Link> link = s.find(id, doing);
  std::lock_guard lock(s.mutex);
  if (std::string why = s.lost_reason(*link); !why.empty())
    fail(ErrorKind::kPeerLost, "lost {} while {}: {}", link->label, doing, why);
}

bool LocalSocketEndpoint::alive(LinkId id) {
  State& s = *state_;
  std::lock_guard lock(s.mutex);
  auto it = s.links.find(id);
  return it != s.links.end() && s.lost_reason(*it->second).empty();
}

void LocalSocketEndpoint::set_handler(uint8_t channel, Handler handler) {
  std::lock_guard lock(state_->mutex);
  state_->handlers[channel] = std::move(handler);
}

void LocalSocketEndpoint::State::run() {
  std::vector<pollfd> fds;
  std::vector<std::shared_ptr<Link>> watched;
  while (!stopping) {
    fds.clear();
    watched.clear();
    fds.push_back({wake_read, POLLIN, 0});
    fds.push_back({listen_fd, POLLIN, 0});
    for (auto& in : inbound) fds.push_back({in->fd, POLLIN, 0});
    {
      std::lock_guard lock(mutex);
      for (auto& [id, link] : links) {
        if (link->closed) continue;
        watched.push_back(link);
        fds.push_back({link->fd, POLLIN, 0});
      }
    }
    int n = ::poll(fds.data(), fds.size(), -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      spdlog::error("control channel @{}: poll failed: {}", socket_name_of(tag, id), std::strerror(errno));
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    if (fds[0].revents != 0) {
      uint8_t drain[64];
      while (::read(wake_read, drain, sizeof(drain)) > 0) {
      }
    }
    if (stopping) break;
    // Messages for handlers are delivered after the lock is released, in arrival order.
    std::vector<HandledMessage> handled;
    const size_t inbound_count = inbound.size();
    bool link_event = false;
    for (size_t i = 0; i < watched.size(); ++i) link_event |= fds[2 + inbound_count + i].revents != 0;
    // A link that ends may mean its peer is gone: everything that peer sent before (on its own
    // connection to us, perhaps not even accepted yet) is already here, and must be queued before
    // the loss is, so that receive() delivers it first. So then accept and read everything.
    const size_t accepted_from = inbound.size();
    if (fds[1].revents != 0 || link_event) accept_all();
    std::vector<size_t> finished;
    for (size_t i = 0; i < inbound.size(); ++i) {
      const bool ready = i < inbound_count ? fds[2 + i].revents != 0 : i >= accepted_from;
      if (!ready && !link_event) continue;
      if (!read_inbound(*inbound[i], handled)) finished.push_back(i);
    }
    for (auto it = finished.rbegin(); it != finished.rend(); ++it) inbound.erase(inbound.begin() + *it);
    for (size_t i = 0; i < watched.size(); ++i) {
      if (fds[2 + inbound_count + i].revents != 0) watch_link(watched[i]);
    }
    for (HandledMessage& h : handled) {
      try {
        h.handler(h.sender, std::move(h.message));
      } catch (const std::exception& e) {
        spdlog::error("control channel @{}: a message handler failed: {}", socket_name_of(tag, id), e.what());
      }
    }
  }
}

void LocalSocketEndpoint::State::accept_all() {
  while (true) {
    int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        spdlog::warn("control channel @{}: accept failed: {}", socket_name_of(tag, id), std::strerror(errno));
      return;
    }
    auto in = std::make_unique<Inbound>();
    in->fd = fd;
    inbound.push_back(std::move(in));
  }
}

void LocalSocketEndpoint::State::watch_link(const std::shared_ptr<Link>& link) {
  uint8_t buffer[64];
  ssize_t n = ::recv(link->fd, buffer, sizeof(buffer), MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  if (n > 0) {
    spdlog::warn("control channel @{}: {} wrote on a connection it only reads; closing it", socket_name_of(tag, id),
                 link->label);
  }
  {
    std::lock_guard lock(mutex);
    link->closed = true;
    ++activity;
  }
  changed.notify_all();
}

void LocalSocketEndpoint::State::close_inbound(Inbound& in, const std::string& why) {
  if (!why.empty()) spdlog::warn("control channel @{}: {}", socket_name_of(tag, id), why);
  if (!in.introduced) return;
  {
    std::lock_guard lock(mutex);
    Sender& sender = senders[in.sender];
    --sender.open;
    if (!in.said_bye) sender.crashed = true;
    ++activity;
  }
  changed.notify_all();
}

bool LocalSocketEndpoint::State::read_inbound(Inbound& in, std::vector<HandledMessage>& handled) {
  bool open = true;
  while (true) {
    const size_t old_size = in.buffer.size();
    in.buffer.resize(old_size + kReadChunk);
    ssize_t n = ::recv(in.fd, in.buffer.data() + old_size, kReadChunk, MSG_DONTWAIT);
    in.buffer.resize(old_size + static_cast<size_t>(std::max<ssize_t>(n, 0)));
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      open = false;  // ECONNRESET and the like: the peer is gone
      break;
    }
    if (n == 0) {
      open = false;
      break;
    }
    if (static_cast<size_t>(n) < kReadChunk) break;
  }

  bool delivered = false;
  std::string malformed;
  try {
    while (true) {
      const std::string from = in.introduced ? "endpoint " + to_hex(in.sender) : "a new connection";
      const auto frame = control_frame::decode_frame(std::span<const uint8_t>(in.buffer).subspan(in.consumed), from);
      if (!frame.complete) {
        if (frame.bytes > 0) in.buffer.reserve(in.consumed + frame.bytes);
        break;
      }
      in.consumed += frame.bytes;
      if (!in.introduced) {
        const control_frame::Hello hello = control_frame::decode_hello(frame, from);
        if (hello.target != id) {
          malformed = fmt::format("it was meant for endpoint {}", to_hex(hello.target));
          break;
        }
        in.sender = hello.sender;
        in.introduced = true;
        std::lock_guard lock(mutex);
        ++senders[in.sender].open;
        continue;
      }
      if (frame.type == FrameType::kBye) {
        in.said_bye = true;
        continue;
      }
      if (frame.type != FrameType::kData) {
        malformed = "it sent a second HELLO";
        break;
      }
      Bytes message(frame.payload.begin(), frame.payload.end());
      std::lock_guard lock(mutex);
      auto handler = handlers.find(frame.channel);
      if (handler != handlers.end()) {
        handled.push_back({handler->second, in.sender, std::move(message)});
      } else {
        senders[in.sender].queues[frame.channel].push_back(std::move(message));
        ++activity;
        delivered = true;
      }
    }
  } catch (const Error& e) {
    malformed = e.what();
  }
  // Drop what was consumed once it is the larger part, so that a long stream stays small.
  if (in.consumed > 0 && in.consumed * 2 >= in.buffer.size()) {
    in.buffer.erase(in.buffer.begin(), in.buffer.begin() + static_cast<std::ptrdiff_t>(in.consumed));
    in.consumed = 0;
  }
  if (delivered) changed.notify_all();
  if (!malformed.empty()) {
    close_inbound(in, fmt::format("closing a control connection{}: {}",
                                  in.introduced ? " from " + to_hex(in.sender) : "", malformed));
    return false;
  }
  if (!open) {
    close_inbound(in, {});
    return false;
  }
  return true;
}

// ---- identity ----

LocalIdentity local_identity() {
  static std::mutex mutex;
  static pid_t cached_pid = 0;
  static EndpointId token{};
  static std::string host;
  std::lock_guard lock(mutex);
  const pid_t pid = ::getpid();
  if (pid != cached_pid) {
    token = random_id();
    cached_pid = pid;
  }
  if (host.empty()) {
    const ProcessIdentity self = this_process();
    host = (self.boot_id.empty() ? "unknown-boot" : self.boot_id) + "/" + self.hostname;
  }
  return {host, token, static_cast<uint32_t>(pid)};
}

}  // namespace refit
