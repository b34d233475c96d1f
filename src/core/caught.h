// What a caught exception was, as refit reports it to its caller and to its peers: every failure
// ends the refit on both sides at once, whatever was thrown (docs/RELIABILITY.md).
#pragma once

#include <exception>
#include <string>
#include <string_view>

#include "refit/error.h"

namespace refit {

struct Caught {
  ErrorKind kind = ErrorKind::kInternal;
  std::string what;
};

// An Error keeps its kind and message; std::bad_alloc is kInternal "out of memory
// (std::bad_alloc)"; std::system_error (a thread that cannot start, a failed system call) is
// kInternal with its code; any other std::exception is `caller_kind` with `caller_prefix` before
// its message (the caller's code failed: a weight stream, a loader); anything else is kInternal
// "<who> threw something that is not a std::exception".
Caught describe_caught(std::exception_ptr caught, ErrorKind caller_kind, std::string_view caller_prefix,
                       std::string_view who);

}  // namespace refit
