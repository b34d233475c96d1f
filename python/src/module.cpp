// refit._refit: the C++ extension module of the `refit` Python package.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "common.h"
#include "core/log_pattern.h"

NB_MODULE(_refit, m) {
  m.doc() = "refit's C++ engine (checkpoint engine, configuration, bucket sizing) for Python. Use the `refit` package.";
  // refit's log goes to stderr (spdlog's default logger writes to stdout, where it would mix with
  // the program's own output), in refit's format (REFIT_LOG_FORMAT), in every process that imports
  // refit: drivers, and the worker processes that refit's groups spawn.
  auto logger = std::make_shared<spdlog::logger>("", std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  logger->set_level(spdlog::default_logger()->level());
  spdlog::set_default_logger(std::move(logger));
  spdlog::set_pattern(refit::log_pattern(""));
  refit::py::register_errors(m);
  refit::py::register_config(m);
  refit::py::register_tensors(m);
  refit::py::register_engine(m);
  refit::py::register_fp8(m);
  refit::py::register_synchronizer(m);
  refit::py::register_expert_loader(m);
#ifdef REFIT_PYTHON_VERSION
  m.attr("__version__") = REFIT_PYTHON_VERSION;
#endif
}
