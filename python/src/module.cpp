// refit._refit: the C++ extension module of the `refit` Python package.
#include "common.h"
#include "refit/logging.h"

NB_MODULE(_refit, m) {
  m.doc() = "refit's C++ engine (checkpoint engine, configuration, bucket sizing) for Python. Use the `refit` package.";
  // In every process that imports refit: drivers, and the workers that refit's groups spawn.
  refit::log_to_stderr("");
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
