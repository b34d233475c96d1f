// One format for every log line of a refit run, whichever process writes it (the driver, a
// forked worker, a launched rank): time, who, level, message. REFIT_LOG_FORMAT=plain gives the
// message alone, so that the reference's markers ("[vLLM refit] ...", "[checkpoint engine] ...")
// start the line, as its print() lines do, for dashboards that match them at the line's start.
#pragma once

#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <strings.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

namespace refit {

// spdlog's pattern for lines written by `who` ("driver", "destination rank 0"; empty: no who, as
// spdlog writes an unnamed logger's lines). Any other REFIT_LOG_FORMAT than plain is the default.
inline std::string log_pattern(std::string_view who) {
  const char* format = std::getenv("REFIT_LOG_FORMAT");
  if (format && strcasecmp(format, "plain") == 0) return "%v";
  if (who.empty()) return "[%Y-%m-%d %H:%M:%S.%e] [%l] %v";
  return fmt::format("[%Y-%m-%d %H:%M:%S.%e] [{}] [%l] %v", who);
}

// Makes refit's log go to stderr in that format (spdlog's default logger writes to stdout, where
// it would mix with a program's own output), keeping the level. Processes forked afterwards
// inherit it and set only their pattern.
inline void log_to_stderr(std::string_view who) {
  auto logger = std::make_shared<spdlog::logger>("", std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  logger->set_level(spdlog::default_logger()->level());
  spdlog::set_default_logger(std::move(logger));
  spdlog::set_pattern(log_pattern(who));
}

}  // namespace refit
