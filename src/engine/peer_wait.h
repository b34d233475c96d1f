// Waiting for a peer's next control message without waiting on a dead peer: the wait is cut
// into slices, and between slices a peer on this host is checked for being alive, so a killed
// process is reported within a slice even when the transport has no way to tell.
#pragma once

#include <chrono>
#include <optional>
#include <string>

#include "core/process_identity.h"
#include "refit/ext/transport.h"

namespace refit {

// The error for a peer on this host whose process is gone: Error(kPeerLost) "lost <label>: its
// process (pid N) is gone", then `cause` (what a transport said of it) in parentheses; nothing
// while it lives or where it is on another host.
std::optional<Error> gone_peer(const std::string& label, const ProcessIdentity& process, const std::string& cause = "");

// Returns the message. Throws Error(kPeerLost) naming `label` when the peer process is gone,
// Error(kTimeout) past the deadline.
Bytes receive_watching(Transport& transport, PeerId peer, const std::string& label, const ProcessIdentity& process,
                       Deadline deadline);

}  // namespace refit
