// Where refit's log goes and how its lines look. Every process of a refit writes one format:
// time, who, level, message ("[2026-12-05 06:16:08.123] [destination rank 0] [info] ...").
// REFIT_LOG_FORMAT=plain gives the message alone, so that the reference's markers ("[vLLM
// refit] ...", "[checkpoint engine] ...") start the line, for dashboards that match them there.
#pragma once

#include <string_view>

namespace refit {

// Sends refit's log to stderr in that format, lines written by `who` ("driver"; empty: no who),
// keeping the level. Processes forked afterwards inherit it. A program calls it once, early; the
// `refit` command and the Python package do.
void log_to_stderr(std::string_view who);

}  // namespace refit
