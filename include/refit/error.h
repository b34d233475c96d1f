// refit::Error is the one exception type refit throws. Its kind says what a caller can do about
// it (fix the config, replace a peer, retry after a timeout); its message names the key, tensor,
// peer rank and phase involved.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace refit {

enum class ErrorKind {
  kConfig,  // a configuration key has a bad value, or an unknown key was given
  kInvalidArgument,
  kModel,      // a model description (config.json, safetensors) is missing or malformed
  kTopology,   // world sizes and ranks do not form a valid pairing
  kLayout,     // a destination layout does not match the model
  kTransport,  // the transport failed to set up or to move bytes
  kTimeout,    // a wait passed its deadline
  kPeerLost,   // a peer process went away
  kIntegrity,  // received bytes do not match what was sent
  kProtocol,   // a peer sent metadata or a message that is malformed or does not match ours
  kIo,
  kUnsupported,  // asked for something this build or machine cannot do
  kInternal,
};

std::string_view to_string(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

}  // namespace refit
