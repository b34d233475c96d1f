// A framed message channel over a stream socket (a socket pair, or TCP across hosts) between the
// driver and one worker process: 8-byte length, then a JSON value (channel_frame.h). Every receive has a deadline; a
// closed peer is reported as such, so a dead worker is noticed at once.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "refit/deadline.h"

namespace refit {

class Channel {
 public:
  Channel() = default;
  Channel(int fd, std::string peer) : fd_(fd), peer_(std::move(peer)) {}
  ~Channel();
  Channel(Channel&& other) noexcept;
  Channel& operator=(Channel&& other) noexcept;

  // Throws Error(kTimeout) when the other end takes nothing until the deadline, Error(kPeerLost)
  // when it closed.
  void send(const nlohmann::json& message, Deadline deadline = deadline_after(std::chrono::seconds(30)));
  // Throws Error(kTimeout) past the deadline and Error(kPeerLost) when the other end closed.
  nlohmann::json receive(Deadline deadline);
  // Like receive(), with no deadline: for a worker idling between commands, whose only way out
  // is its driver closing the channel.
  nlohmann::json receive_forever();

  int fd() const { return fd_; }
  const std::string& peer() const { return peer_; }
  // Names the other end in errors (once it has said who it is).
  void set_peer(std::string peer) { peer_ = std::move(peer); }
  void close();

 private:
  nlohmann::json receive_frame(Deadline deadline, bool forever);
  bool read_exact(void* out, size_t n, Deadline deadline, bool forever);
  int fd_ = -1;
  std::string peer_;
};

}  // namespace refit
