// Waiting for a peer's next control message without waiting on a dead peer: the wait is cut
// into short slices, and between slices a peer on this host is checked for being alive, so a
// killed process is reported within a slice even when the transport has no way to tell.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "core/process_identity.h"
#include "refit/transport.h"

namespace refit {

// Returns the message, or nothing when `stopped` became true. Throws Error(kPeerLost) naming
// `label` when the peer process is gone, Error(kTimeout) past the deadline.
std::optional<Bytes> receive_watching(Transport& transport, PeerId peer, const std::string& label,
                                      const ProcessIdentity& process, Deadline deadline,
                                      const std::function<bool()>& stopped = {});

}  // namespace refit
