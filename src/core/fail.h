// Throwing refit::Error with a formatted message, in one line at the call site.
#pragma once

#include <fmt/format.h>

#include "refit/error.h"

namespace refit {

template <typename... Args>
[[noreturn]] void fail(ErrorKind kind, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(kind, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace refit
