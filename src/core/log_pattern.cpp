#include "core/log_pattern.h"

#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <strings.h>

#include <cstdlib>
#include <memory>

#include "refit/logging.h"

namespace refit {

std::string log_pattern(std::string_view who) {
  const char* format = std::getenv("REFIT_LOG_FORMAT");
  if (format && strcasecmp(format, "plain") == 0) return "%v";
  if (who.empty()) return "[%Y-%m-%d %H:%M:%S.%e] [%l] %v";
  return fmt::format("[%Y-%m-%d %H:%M:%S.%e] [{}] [%l] %v", who);
}

void log_to_stderr(std::string_view who) {
  // spdlog's default logger writes to stdout, where it would mix with a program's own output.
  auto logger = std::make_shared<spdlog::logger>("", std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  logger->set_level(spdlog::default_logger()->level());
  spdlog::set_default_logger(std::move(logger));
  spdlog::set_pattern(log_pattern(who));
}

}  // namespace refit
