// refit._refit: the C++ extension module of the `refit` Python package.
#include <atomic>

#include "common.h"
#include "refit/logging.h"

namespace refit::py {
namespace {

std::atomic<bool> g_exiting{false};
std::thread::id g_exit_thread;     // written before g_exiting is set, read after
std::atomic<int> g_taking_gil{0};  // threads between deciding to take the GIL back and having it

// atexit: only daemon threads are left, and finalizing has not begun.
void mark_exiting() {
  g_exit_thread = std::this_thread::get_id();
  g_exiting.store(true);
  // Those that decided before the mark take the GIL back now, while that is still safe.
  GilRelease nogil;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (g_taking_gil.load() > 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

}  // namespace

void GilRelease::take_back(PyThreadState* state) {
  // Counted before looking at the mark (both sequentially consistent): either this thread sees it
  // and parks, or the hook sees this thread and waits until it has the GIL.
  g_taking_gil.fetch_add(1);
  if (g_exiting.load() && std::this_thread::get_id() != g_exit_thread) {
    g_taking_gil.fetch_sub(1);
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  }
  PyEval_RestoreThread(state);
  g_taking_gil.fetch_sub(1);
}

}  // namespace refit::py

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
  // atexit runs once the interpreter has joined every thread but its daemon threads, before it
  // starts finalizing (GilRelease).
  nb::module_::import_("atexit").attr("register")(nb::cpp_function(&refit::py::mark_exiting));
#ifdef REFIT_PYTHON_VERSION
  m.attr("__version__") = REFIT_PYTHON_VERSION;
#endif
}
