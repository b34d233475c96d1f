// One format for every log line of a refit run, whichever process writes it (the driver, a
// forked worker, a launched rank): time, who, level, message.
#pragma once

#include <fmt/format.h>

#include <string>
#include <string_view>

namespace refit {

// spdlog's pattern for lines written by `who` ("driver", "destination rank 0").
inline std::string log_pattern(std::string_view who) { return fmt::format("[%Y-%m-%d %H:%M:%S.%e] [{}] [%l] %v", who); }

}  // namespace refit
