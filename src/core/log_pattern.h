// The pattern of refit's log lines (refit/logging.h), for the processes that set it themselves
// (forked workers, launched ranks): time, who, level, message; REFIT_LOG_FORMAT=plain: the
// message alone.
#pragma once

#include <string>
#include <string_view>

namespace refit {

// spdlog's pattern for lines written by `who` ("driver", "destination rank 0"; empty: no who, as
// spdlog writes an unnamed logger's lines). Any other REFIT_LOG_FORMAT than plain is the default.
std::string log_pattern(std::string_view who);

}  // namespace refit
