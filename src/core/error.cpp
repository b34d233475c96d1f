#include "refit/error.h"

namespace refit {

std::string_view to_string(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kConfig:
      return "config";
    case ErrorKind::kInvalidArgument:
      return "invalid argument";
    case ErrorKind::kModel:
      return "model";
    case ErrorKind::kTopology:
      return "topology";
    case ErrorKind::kLayout:
      return "layout";
    case ErrorKind::kTransport:
      return "transport";
    case ErrorKind::kTimeout:
      return "timeout";
    case ErrorKind::kPeerLost:
      return "peer lost";
    case ErrorKind::kIntegrity:
      return "integrity";
    case ErrorKind::kProtocol:
      return "protocol";
    case ErrorKind::kIo:
      return "io";
    case ErrorKind::kUnsupported:
      return "unsupported";
    case ErrorKind::kInternal:
      return "internal";
  }
  return "unknown";
}

}  // namespace refit
