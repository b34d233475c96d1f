// TCP sockets for the driver <-> worker channels of ranks on several hosts: every call has a
// deadline, every error names the address. Connections give up on a silent peer after about
// `timeout_s` (refit's timeout_s), not before.
#pragma once

#include <string>

#include "refit/deadline.h"

namespace refit {

// A listening socket at host:port (host: an address or a name of this host). Error(kIo) names it.
int tcp_listen(const std::string& host, int port);
// The next connection on a listening socket; Error(kTimeout) past the deadline.
int tcp_accept(int listener, Deadline deadline, double timeout_s);
// Connects to host:port, retrying while nobody listens there yet (the listener may start later);
// past the deadline, Error(kTimeout) whose message is the last attempt's error (the caller names
// the address and what it was for).
int tcp_connect(const std::string& host, int port, Deadline deadline, double timeout_s);

}  // namespace refit
